"""The operator docs say what the code does: the configuration defaults of
:class:`kvtier.core.config.KVTierConfig` (the key tables of docs/vllm.md and docs/shared-tier.md,
prose such as "(128, the default, is)"), serve lines that let kvtier flush on SIGTERM, and
the quick start's request, run as written."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvtier.core.config import KVTierConfig
from kvtier.launch.serve import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "vllm.md", ROOT / "docs" / "shared-tier.md"]


def config_defaults() -> dict[str, object]:
    """Every configuration key's default: the configuration's own fields and each registered tier's
    settings keys (given flat, as the docs' tables show them)."""
    config = KVTierConfig.from_dict({})
    return {**config.model_dump(), **config.flat_dict()}


def documented_defaults(path: Path) -> list[tuple[str, str]]:
    """``(key, default cell)`` of every table row whose first cell names config keys (``a`` / ``b``)."""
    fields = KVTierConfig.known_keys()
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        keys = re.findall(r"`([a-z_]+)`", cells[0]) if line.startswith("| `") else []
        if not keys or not all(k in fields for k in keys):
            continue
        default = cells[2] if len(cells) >= 4 and path.name == "vllm.md" else cells[1]  # vllm.md has a unit column
        values = [v.strip() for v in default.split(" / ")]
        rows.extend(zip(keys, values if len(values) == len(keys) else values * len(keys), strict=True))
    return rows


def matches(cell: str, default: object) -> bool:
    if isinstance(default, dict | list | tuple):  # "`{}` (all)": the first literal, as YAML
        literal = re.match(r"`([^`]*)`", cell)
        value = yaml.safe_load(literal.group(1)) if literal else None
        return isinstance(value, dict | list) and (list(value) if isinstance(value, list) else value) == (
            list(default) if isinstance(default, tuple | list) else default)
    text = cell.strip("`")
    if default is None:
        return text.startswith("unset") or not re.fullmatch(r"[\d.]+|true|false", text)  # "system CAs"
    if isinstance(default, bool):
        return text == str(default).lower()
    if isinstance(default, int | float):
        return re.fullmatch(r"[\d.]+", text) is not None and float(text) == float(default)
    return text == str(default)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_key_tables_state_the_real_defaults(path: Path):
    rows = documented_defaults(path)
    assert len(rows) >= 10, f"found only {rows} in {path.name}: did the table format change?"
    defaults = config_defaults()
    wrong = [(key, cell, defaults[key]) for key, cell in rows if not matches(cell, defaults[key])]
    assert wrong == []


def test_the_key_tables_cover_every_key_of_the_built_in_tiers():
    """The redis tier's keys live in its own settings model now (issue 20 item 1): the tables still
    document each of them, so they still count as configuration keys here."""
    documented = {key for path in DOCS for key, _cell in documented_defaults(path)}
    redis_keys = {k for k in config_defaults() if k.startswith("redis_")}
    assert len(redis_keys) == 11 and redis_keys <= documented, redis_keys - documented


def test_the_policy_row_names_every_policy_the_config_accepts():
    """docs/vllm.md's ``policy`` row left out ``adaptive-unguarded``, which the configuration accepts
    (fresh-user tester): the row names every policy :func:`available_policies` lists."""
    from kvtier.core.policies.registry import available_policies

    row = next(line for line in (ROOT / "docs" / "vllm.md").read_text().splitlines() if line.startswith("| `policy` |"))
    named = set(re.findall(r"`([a-z0-9-]+)`", row.split("|")[4]))
    assert set(available_policies()) <= named, set(available_policies()) - named


def test_prose_names_the_real_tiers_default():
    """docs/vllm.md said ``tiers`` defaults to ``["cpu", "disk", "redis"]`` and docs/store.md ``cpu, disk,
    redis``, while the configuration's default is every registered tier, node and s3 included
    (fresh-user tester): each statement of the default names exactly the tiers of the default, in order."""
    default = list(KVTierConfig.from_dict({}).tiers)
    vllm = re.search(r"`tiers` \(a list, default `(\[[^`]*\])`\)", (ROOT / "docs" / "vllm.md").read_text())
    assert vllm is not None and json.loads(vllm.group(1)) == default, vllm and vllm.group(1)
    store = re.search(r"default: every registered tier in its record's order, `([^`]*)`",
                      " ".join((ROOT / "docs" / "store.md").read_text().split()))
    assert store is not None and [t.strip() for t in store.group(1).split(",")] == default, store and store.group(1)


def test_the_store_tier_table_is_one_table():
    """A blank line inside docs/store.md's tier table cut its ``redis`` row off into a paragraph of pipes
    (fresh-user tester): the table's rows follow each other."""
    lines = (ROOT / "docs" / "store.md").read_text().splitlines()
    head = lines.index("| tier | what | capacity | guarantees |")
    end = head
    while end + 1 < len(lines) and lines[end + 1].startswith("|"):
        end += 1
    rows = {re.match(r"\| `([a-z0-9]+)`", line).group(1) for line in lines[head + 2:end + 1]}
    assert "redis" in rows, rows


def test_no_table_is_cut_by_a_blank_line():
    """docs/audit.md's inputs table had a blank line before its kustomize row, which Markdown then shows
    as a paragraph of pipes (fresh-user tester): a row after a blank line that follows a table row
    starts a new table only with a header and its separator line."""
    cut = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i in range(1, len(lines) - 2):
            if (lines[i] == "" and lines[i - 1].startswith("|") and lines[i + 1].startswith("|")
                    and not re.fullmatch(r"\|[ :|-]+\|", lines[i + 2])):
                cut.append(f"{path.name}:{i + 2}")
    assert cut == []


@pytest.mark.parametrize("path", [*DOCS, ROOT / "README.md", ROOT / "docs" / "quickstart.md", ROOT / "docs" / "store.md"], ids=lambda p: p.name)
def test_prose_names_the_real_chunk_tokens_default(path: Path):
    default = KVTierConfig.from_dict({}).chunk_tokens
    # "(256, the default, is)" / "chunk_tokens (default 256)" near a mention of chunk_tokens
    text = " ".join(path.read_text().split())
    claims = re.findall(r"chunk_tokens`?[^.]{0,80}?\(?`?(\d+|auto)`?,? (?:the default|by default)"
                        r"|chunk_tokens`? \(default `?(\d+|auto)`?", text)
    stated = {int(v) if v.isdigit() else v for v in (a or b for a, b in claims)}
    assert stated <= {default}, f"{path.name} says the chunk_tokens default is {stated}, it is {default}"


def shell_commands(path: Path) -> list[str]:
    """Every command of the fenced shell (or untagged) blocks of ``path``, continuations and quoted newlines joined."""
    commands: list[str] = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), flags=re.DOTALL):
        pending = ""
        for line in block.splitlines():
            pending += line + "\n"
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if not line.rstrip().endswith("\\"):
                commands.append(pending)
                pending = ""
    return commands


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "quickstart.md", *DOCS], ids=lambda p: p.name)
def test_every_kvtier_serve_line_stops_gracefully_on_sigterm(path: Path):
    # without --shutdown-timeout vLLM 0.32's api_server force-kills its workers on SIGTERM: no flush (docs/vllm.md)
    serve = [c for c in shell_commands(path)
             if re.search(r"vllm serve|vllm\.entrypoints\.openai\.api_server", c) and "--kv-transfer-config" in c]
    assert serve, f"no serve line with --kv-transfer-config found in {path.name}"
    assert [c for c in serve if "--shutdown-timeout" not in c] == []


def test_readme_request_is_greedy_so_its_repeat_gives_the_same_text(tmp_path: Path):
    # docs/quickstart.md step 4 sends one request twice and says the repeat's KV is found: sampled answers would differ
    (command,) = [c for c in shell_commands(ROOT / "docs" / "quickstart.md") if "random_prompt" in c]
    snippet = shlex.split(command.split(">")[0])
    assert snippet[:2] == ["python", "-c"]
    run = subprocess.run([sys.executable, "-c", snippet[2]], capture_output=True, text=True, check=True, timeout=300,
                         cwd=tmp_path)
    request = json.loads(run.stdout)
    assert request["temperature"] == 0 and request["max_tokens"] > 0 and len(request["prompt"]) > 1000


def test_shared_tier_docs_say_whether_the_connector_reads_redis():
    # breaker F10: the docs promised cross-replica hits while the connector only wrote to Redis
    connector = "\n".join(p.read_text() for p in (ROOT / "src" / "kvtier" / "integrations" / "vllm").rglob("*.py"))
    # the remote-lookup entry points: the redis tier's own presence batch (scheduler/remote.py)
    reads_shared = any(name in connector for name in ("lookup_async", "PendingLookup", "contains_many"))
    shared_doc = (ROOT / "docs" / "shared-tier.md").read_text()
    vllm_doc = (ROOT / "docs" / "vllm.md").read_text()
    says_not_yet = "not yet" in shared_doc.lower() or "does not yet look there" in vllm_doc
    promises_hits = "a prompt prefilled on :8001 is a hit on :8002" in shared_doc
    assert (promises_hits and not says_not_yet) == reads_shared, \
        "update docs/shared-tier.md and docs/vllm.md: whether the connector reads Redis"


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "quickstart.md", *DOCS, ROOT / "docs" / "s3.md"],
                         ids=lambda p: p.name)
def test_every_kvtier_serve_line_passes_the_audit_of_its_shutdown(path: Path):
    """`kvtier audit` on the docs' own serve lines: README's and vllm.md's disk-tier lines and the quick
    start's drew kvtier-worker-shutdown-timeout-short (vLLM SIGTERMs a worker after 5 s, while kvtier's
    flush may take 30) (tester4).  A ``"$CONFIG"`` is read from the same document's ``CONFIG='...'``."""
    from kvtier.audit.engine import audit
    from kvtier.audit.loader import load_configs
    from kvtier.audit.versions import parse_version

    text = path.read_text()
    assigned = dict(re.findall(r"^(\w+)='(\{.*?\})'$", text, flags=re.DOTALL | re.MULTILINE))
    serve = [c for c in shell_commands(path)
             if re.search(r"vllm serve|vllm\.entrypoints\.openai\.api_server", c) and "--kv-transfer-config" in c]
    audited = 0
    for command in serve:
        for name, value in assigned.items():
            command = command.replace(f'"${name}"', shlex.quote(" ".join(value.split())))
        findings = audit(load_configs(command, path.name, parse_version("0.32.0")))
        if any(f.rule == "kv-transfer-config-invalid" for f in findings):  # an elided config ("...")
            continue
        audited += 1
        assert [f.message for f in findings if f.rule == "kvtier-worker-shutdown-timeout-short"] == [], command
    assert audited >= 1, f"no serve line of {path.name} could be audited"


def test_the_quickstart_wait_for_the_server_ends_when_the_server_exits(tmp_path: Path):
    """docs/quickstart.md step 3 waited with `until curl ...; do sleep 2; done`: a server that exited at
    start left it looping forever (new user 5). The wait, run as written against a server that dies at
    once, ends within seconds and shows the end of the server's log."""
    lines = (ROOT / "docs" / "quickstart.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("DEADLINE="))
    end = next(i for i in range(start, len(lines)) if lines[i] == "done")
    wait = "\n".join(lines[start:end + 1]).replace("127.0.0.1:8000", f"127.0.0.1:{free_port()}")
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:  # no other doc waits unbounded
        text = doc.read_text().splitlines()
        assert [i for i, line in enumerate(text) if "until curl" in line
                and not any("kill -0" in after for after in text[i:i + 4])] == [], doc.name
    (tmp_path / ".kvtier").mkdir()
    script = ("sh -c 'echo the model would not load >> .kvtier/serve.log; exit 1' &\nSERVER=$!\nsleep 1\n"
              + wait + "\n")
    began = time.monotonic()
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          check=False)
    assert time.monotonic() - began < 30
    assert done.stdout.splitlines() == ["vLLM exited; the end of .kvtier/serve.log:", "the model would not load"]
