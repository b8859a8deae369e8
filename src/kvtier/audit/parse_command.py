"""Read a ``vllm serve …`` command line (a shell snippet, a ``docker run``) or an env file.

Shell words are split with :mod:`shlex` (quotes, backslash continuations and ``#`` comments work
as in a shell).  ``export K=V`` lines (or ``K=V`` then ``export K``, ``declare -x K=V``), ``K=V``
assignments inside a ``set -a`` region, ``K=V`` prefixes of the serve command (``env K=V`` too) and
``docker run -e K=V`` set the server's environment; a plain ``K=V`` line does not (the shell keeps an
unexported variable to itself: it goes to :attr:`ServeConfig.unexported`, and expands ``$K`` only); ``vllm serve`` (or ``python -m vllm.entrypoints.openai.api_server``, or the arguments
after a vLLM image in ``docker run``: a ``vllm-openai`` image, or the image ``docker run`` names when
its name has ``vllm`` in it, as deploy/Dockerfile's ``kvtier-vllm``) starts the vLLM arguments.  Dotted flags
(``--kv-transfer-config.kv_role=kv_both``, ``--kv-transfer-config.kv_role kv_both``) are kept as
flags of that name; :mod:`kvtier.audit.dotted` merges them as vLLM does.  ``$NAME`` / ``${NAME}`` in
the vLLM arguments are expanded from simple assignments earlier in the snippet (``NAME='…'``,
``NAME="…"``, ``export NAME=…``: the quick start's ``CONFIG='{…}'`` then ``--kv-transfer-config
"$CONFIG"``); a variable the snippet does not assign is kept as written and named in
:attr:`ServeConfig.unresolved` (rule ``shell-variable-unresolved``).
"""

from __future__ import annotations

import re
import shlex

from kvtier.audit.model import ServeConfig
from kvtier.core.errors import UserError

_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_STOP = {"&&", "||", ";", "|", "&"}
VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")

BOOL_FLAGS = frozenset({
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--no-enforce-eager",
    "--disable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager", "--calculate-kv-scales",
    "--trust-remote-code", "--disable-log-requests", "--disable-log-stats", "--enable-log-requests",
    "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--enable-auto-tool-choice",
    "--async-scheduling", "--no-async-scheduling", "--enable-expert-parallel", "--disable-custom-all-reduce",
    "--enable-lora", "--headless", "--enable-sleep-mode", "--skip-tokenizer-init", "--enable-prompt-embeds",
    "--disable-frontend-multiprocessing", "--enable-server-load-tracking",
})
"""vLLM switches that take no value (so the word after them is not swallowed as one)."""


def normalise_flag(word: str) -> str:
    """``--foo_bar`` → ``--foo-bar`` (vLLM accepts both spellings); in a dotted flag only the part
    before the first dot (``--kv_transfer_config.kv_role`` → ``--kv-transfer-config.kv_role``), as
    vLLM's ``FlexibleArgumentParser.parse_args`` does (vllm/utils/argparse_utils.py)."""
    if not word.startswith("--"):
        return word
    name, dot, keys = word[2:].partition(".")
    return "--" + name.replace("_", "-") + dot + keys


def parse_vllm_args(words: list[str], config: ServeConfig) -> None:
    """Fill ``config.flags`` / ``config.positionals`` from the words after ``vllm serve``."""
    i = 0
    while i < len(words):
        word = words[i]
        if word in _STOP:
            break
        if word.startswith("-") and len(word) > 1 and not is_number(word):
            if "=" in word and word.startswith("--"):
                name, value = word.split("=", 1)
                config.flags.append((normalise_flag(name), value))
            else:
                name = normalise_flag(word)
                nxt = words[i + 1] if i + 1 < len(words) else None
                dotted = "." in name and name.startswith("--")  # vLLM takes the next word, whatever it is
                if name not in BOOL_FLAGS and nxt is not None and nxt not in _STOP and (
                        dotted or not nxt.startswith("-") or is_number(nxt)):
                    config.flags.append((name, nxt))
                    i += 1
                else:
                    config.flags.append((name, None))
        else:
            config.positionals.append(word)
        i += 1


def is_number(word: str) -> bool:
    """Whether ``word`` reads as a number (``float``): a negative value, not a flag."""
    try:
        float(word)
    except ValueError:
        return False
    return True


def _split(text: str, origin: str) -> list[str]:
    try:
        return shlex.split(text, comments=True)
    except ValueError as exc:
        raise UserError(f"{origin} is not a valid shell command line ({exc}); check its quotes.") from None


_SUBSTITUTION = re.compile(r"\$\(|`")
"""A command substitution in an assigned value: its output is not in the input."""
_FD_REDIRECT = re.compile(r"(?<=\s)\d+(?=[<>])")
"""The file descriptor of a redirection (the ``2`` of ``2>&1``): a word of its own once lexed."""
_CONTROL = {"&&", "||", ";", "|", "&", ";;", "(", ")", "|&", "\n"}


def _logical_lines(text: str, origin: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, text)`` of each shell command line of ``text`` (1-based): a
    backslash-newline joins two lines (the shell removes it) and a quote left open runs on.

    Raises:
        UserError: a quote is never closed.
    """
    out: list[tuple[int, int, str]] = []
    buffer: list[str] = []
    first = 1
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not buffer:
            first = number
        buffer.append(line)
        joined = "\n".join(buffer)
        if (len(line) - len(line.rstrip("\\"))) % 2 == 1 and number < len(lines):
            continue  # an odd run of trailing backslashes: the line goes on
        try:
            shlex.split(joined.replace("\\\n", " "), comments=True)
        except ValueError:
            if number < len(lines):
                continue
            _split(joined, origin)  # raises the one-sentence error
        out.append((first, number, joined))
        buffer = []
    return out


def _segments(line: str, origin: str) -> list[list[str]]:
    """The simple commands of one command line, as words: split at ``&&``, ``||``, ``;``, ``|``,
    ``&`` and parentheses, with redirections (``> log``, ``2>&1``) dropped."""
    line = _FD_REDIRECT.sub(" ", line.replace("\\\n", " "))
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as exc:
        raise UserError(f"{origin} is not a valid shell command line ({exc}); check its quotes.") from None
    segments: list[list[str]] = [[]]
    skip = False
    depth, inner = 0, []  # an unquoted $( ... ): one word, as the shell substitutes it
    for token in tokens:
        if depth:
            depth += token.count("(") - token.count(")") if token in ("(", ")") else 0
            if depth:
                inner.append(token)
            else:
                segments[-1][-1] += "(" + " ".join(inner) + ")"
        elif token == "(" and segments[-1] and segments[-1][-1].endswith("$"):
            depth, inner = 1, []
        elif skip:
            skip = False
        elif token in _CONTROL:
            segments.append([])
        elif token and set(token) <= set("<>&|") and ("<" in token or ">" in token):
            skip = True
        else:
            segments[-1].append(token)
    return [s for s in segments if s]


def parse_command(text: str, origin: str) -> ServeConfig:
    """The first vLLM server a shell snippet starts (:func:`parse_commands`)."""
    return parse_commands(text, origin)[0]


def parse_commands(text: str, origin: str) -> list[ServeConfig]:
    """One config per vLLM server a shell snippet starts (``vllm serve``, ``python -m
    vllm.entrypoints.openai.api_server``, ``docker run … vllm/vllm-openai`` or another vLLM image,
    :func:`names_vllm`), in order.  Assignments
    and ``export`` lines apply to the commands after them; ``K=V`` prefixes and ``docker run -e`` to
    their own command.  With more than one server each origin names its line (``serve.sh line 3``)
    and its ``text`` keeps only that server's lines of the others', so findings point at it.

    Raises:
        UserError: unbalanced quotes, or no ``vllm serve`` / vLLM image in the text.
    """
    shell = _Shell()
    found: list[tuple[int, int, ServeConfig]] = []
    built_on: str | None = None
    for first, last, line in _logical_lines(text, origin):
        for words in _segments(line, origin):
            if shell.assigns(words):
                continue
            config, base = _parse_segment(words, shell, origin, text)
            built_on = built_on or base
            if config is not None:
                found.append((first, last, config))
    if not found and built_on is not None:
        raise UserError(f"{origin} holds no vLLM serve line to audit (FROM {built_on} builds an image, it starts no "
                        "server); audit the command, compose file or manifest that runs the image.")
    if not found:
        raise UserError(f"{origin} holds no `vllm serve` command, vLLM image or KEY=VALUE lines to audit.")
    if len(found) > 1:
        lines = text.splitlines()
        for first, last, config in found:
            config.origin = f"{origin} line {first}"
            others = {n for f, la, c in found if c is not config for n in range(f, la + 1)}
            config.text = "\n".join("" if n in others else ln for n, ln in enumerate(lines, start=1))
    return [config for _, _, config in found]


class _Shell:
    """The variables a script has set so far: ``exported`` (the server's environment) and
    ``plain`` (assigned without ``export``: expanded in the script, never passed on)."""

    def __init__(self) -> None:
        self.exported: dict[str, str] = {}
        self.plain: dict[str, str] = {}
        self.allexport = False  # inside set -a / set -o allexport

    def assigns(self, words: list[str]) -> bool:
        """Apply ``words`` when they are an assignment command (``set -a``/``+a``, ``export``,
        ``declare -x``, or ``K=V`` words alone); whether they were one."""
        if words[0] == "set":
            for i, word in enumerate(words[1:], start=1):  # set -a, set -ea, set -o allexport (+ turns it off)
                if re.fullmatch(r"[-+][A-Za-z]*a[A-Za-z]*", word) and "o" not in word or \
                        (word in ("-o", "+o") and words[i + 1:i + 2] == ["allexport"]):
                    self.allexport = word.startswith("-")
            return True
        exporting = words[0] == "export" or (words[0] in ("declare", "typeset") and "-x" in words[1:])
        if words[0] in ("export", "declare", "typeset", "readonly", "local"):
            for word in words[1:]:
                if _ASSIGN.match(word):
                    name, value = word.split("=", 1)
                    self.set(name, value, exporting)
                elif exporting and word in self.plain:  # `export NAME` of a variable set before
                    self.set(word, self.plain[word], True)
            return True
        if not all(_ASSIGN.match(word) for word in words):
            return False
        for word in words:
            name, value = word.split("=", 1)
            self.set(name, value, self.allexport)
        return True

    def set(self, name: str, value: str, exported: bool) -> None:
        exported = exported or name in self.exported  # a variable once exported stays exported
        self.plain.pop(name, None)
        self.exported.pop(name, None)
        (self.exported if exported else self.plain)[name] = value


def _parse_segment(words: list[str], shell: _Shell, origin: str,
                   text: str) -> tuple[ServeConfig | None, str | None]:
    """The server one simple command starts (None when it starts none) and the vLLM image a
    Dockerfile's ``FROM`` names; the ``K=V`` prefixes of a command that starts no server apply to
    that command only."""
    config = ServeConfig(origin=origin, text=text, launch=text, env=dict(shell.exported),
                         unexported=dict(shell.plain))
    start: int | None = None
    built_on: str | None = None
    own: dict[str, str] = {}
    image_at = docker_image_index(words)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "export":
            i += 1
            continue
        if word in ("-e", "--env") and i + 1 < len(words) and _ASSIGN.match(words[i + 1]):
            key, value = words[i + 1].split("=", 1)
            own[key] = value
            i += 2
            continue
        if _ASSIGN.match(word) and start is None:
            key, value = word.split("=", 1)
            own[key] = value
        elif word == "serve" and i > 0 and words[i - 1].rsplit("/", 1)[-1] == "vllm" or word == "vllm.entrypoints.openai.api_server":
            start = i + 1
            break
        elif "vllm-openai" in word and not word.startswith("-") and i > 0 and words[i - 1].upper() == "FROM":
            built_on = word  # a Dockerfile's base image: it builds an image, it runs no server
        elif "vllm-openai" in word and not word.startswith("-") or i == image_at and names_vllm(word):
            config.image = word
            start = i + 1
            if start < len(words) and words[start] == "serve":  # image with `serve` as first arg
                start += 1
            break
        i += 1
    if start is None:
        return None, built_on
    config.env.update(own)
    for name in own:
        config.unexported.pop(name, None)
    parse_vllm_args(_expand(words[start:], config, {**shell.plain, **config.env}), config)
    return config, built_on


_DOCKER_SWITCHES = re.compile(r"-[dtiP]+")  # -d, -it, -dit, -P: short options that take no value
_DOCKER_LONG_SWITCHES = frozenset({"--detach", "--interactive", "--tty", "--rm", "--privileged", "--init",
                                   "--read-only", "--publish-all", "--no-healthcheck", "--oom-kill-disable",
                                   "--sig-proxy", "--quiet", "-q"})


def docker_image_index(words: list[str]) -> int | None:
    """Index in ``words`` of the image a ``docker run`` / ``podman run`` (or ``container run``,
    ``create``) names: the first word after ``run`` that is neither an option nor an option's value
    (``--opt value``; ``--opt=value`` and the switches ``-d``, ``-it``, ``--rm``, … take none).
    None when ``words`` are no such command or name no image."""
    for k, word in enumerate(words):
        if word.rsplit("/", 1)[-1] in ("docker", "podman"):
            rest = words[k + 1:k + 3]
            verb = 2 if rest[:1] == ["container"] else 1
            if words[k + verb:k + verb + 1] in (["run"], ["create"]):
                j = k + verb + 1
                break
    else:
        return None
    while j < len(words):
        word = words[j]
        if word == "--":
            return j + 1 if j + 1 < len(words) else None
        if not word.startswith("-") or word == "-":
            return j
        switch = "=" in word or _DOCKER_SWITCHES.fullmatch(word) or word in _DOCKER_LONG_SWITCHES
        j += 1 if switch else 2
    return None


def names_vllm(image: str) -> bool:
    """Whether an image reference names a vLLM image: its repository's last part (tag and digest
    dropped) contains ``vllm`` (``vllm/vllm-openai:v0.32.0``, ``registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0``,
    the image of deploy/Dockerfile, whose entrypoint stays vLLM's ``vllm serve``)."""
    return "vllm" in image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0].lower()


def _expand(words: list[str], config: ServeConfig, variables: dict[str, str]) -> list[str]:
    """``words`` with each ``$NAME`` / ``${NAME}`` replaced by the value the snippet assigned to NAME
    (``variables``, exported or not, read before the serve words); the names it does not assign are
    added to ``config.unresolved`` and left as written."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in variables and not _SUBSTITUTION.search(variables[name]):
            return variables[name]  # a command's output ($(cat f), `cat f`) is not in the input
        if match.group(0) not in config.unresolved:
            config.unresolved.append(match.group(0))
        return match.group(0)

    return [VARIABLE.sub(value, word) for word in words]


def parse_env_file(text: str, origin: str) -> ServeConfig:
    """Parse ``KEY=VALUE`` lines (``export`` and ``#`` comments allowed) into a config with env only."""
    config = ServeConfig(origin=origin, text=text)
    for number, line in enumerate(text.splitlines(), start=1):
        words = _split(line, f"{origin} line {number}")
        if not words:
            continue
        if words[0] == "export":
            words = words[1:]
        for word in words:
            if not _ASSIGN.match(word):
                raise UserError(f"{origin} line {number} is not KEY=VALUE; an env file holds one per line.")
            key, value = word.split("=", 1)
            config.env[key] = value
    return config


def looks_like_env_file(text: str) -> bool:
    """Every non-blank, non-comment line is ``[export ]KEY=VALUE``."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return bool(lines) and all(_ASSIGN.match(ln.removeprefix("export ").strip()) for ln in lines)
