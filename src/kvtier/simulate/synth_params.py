"""The parameters of each synthetic traffic regime (:mod:`kvtier.simulate.synth`): one frozen
dataclass per regime, :data:`REGIMES` naming them, and :func:`make_params`, which reads overrides
given as strings and refuses an unknown name or an out-of-range value (:class:`SynthError`).
Their meaning is documented on each class and in docs/simulate.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ChatParams:
    """Multi-turn chat.

    Attributes:
        rate_per_s: new conversations per second (Poisson).
        system_prompts: distinct system prompts, chosen Zipf(1) (the first is the most used).
        system_tokens: tokens of each system prompt.
        single_turn_share: share of conversations with one turn only.
        mean_turns: mean turns of the others (geometric, >= 2).
        think_median_s, think_sigma: lognormal think time between turns (seconds; the answer's
            generation time included).
        user_median_tokens, answer_median_tokens: lognormal lengths of a user message and an answer.
    """

    rate_per_s: float = 2.0
    system_prompts: int = 4
    system_tokens: int = 1200
    single_turn_share: float = 0.6
    mean_turns: float = 4.0
    think_median_s: float = 90.0
    think_sigma: float = 1.0
    user_median_tokens: float = 350.0
    answer_median_tokens: float = 400.0


@dataclass(frozen=True)
class AgentParams:
    """Agents in tool loops.

    Attributes:
        rate_per_s: new agent sessions per second (Poisson).
        agents: distinct agents (system prompt + tool definitions), chosen Zipf(1).
        system_tokens: tokens of each agent's system prompt and tool definitions.
        mean_steps: mean tool-loop steps per session (geometric, >= 1).
        tool_median_s, tool_sigma: lognormal gap between steps (tool latency + generation), s.
        task_median_tokens: lognormal length of the task that starts a session.
        step_median_tokens: lognormal tokens appended per step (the action and the tool's output).
    """

    rate_per_s: float = 1.0
    agents: int = 3
    system_tokens: int = 6000
    mean_steps: float = 10.0
    tool_median_s: float = 4.0
    tool_sigma: float = 0.8
    task_median_tokens: float = 300.0
    step_median_tokens: float = 500.0


@dataclass(frozen=True)
class RagParams:
    """Retrieval-augmented generation over a Zipf-popular document set.

    Attributes:
        rate_per_s: requests per second (Poisson).
        documents: size of the document set.
        zipf_s: Zipf exponent of document popularity (1.0: classic; larger: more skewed).
        doc_median_tokens, doc_sigma: lognormal document length.
        system_tokens: tokens of the one system prompt before the document.
        question_median_tokens: lognormal length of the (unique) question after the document.
    """

    rate_per_s: float = 5.0
    documents: int = 3000
    zipf_s: float = 0.9
    doc_median_tokens: float = 2000.0
    doc_sigma: float = 0.6
    system_tokens: int = 400
    question_median_tokens: float = 80.0


@dataclass(frozen=True)
class BatchParams:
    """Scan-once batch jobs with a hot set mixed in.

    Attributes:
        rate_per_s: requests per second (Poisson).
        templates: distinct instruction templates (shared prefixes of the scan).
        template_tokens: tokens of each template.
        doc_median_tokens: lognormal length of each scanned (unique) document.
        hot_share: share of requests drawn from the hot set instead of the scan.
        hot_prompts: prompts in the hot set (chosen uniformly), each ``hot_median_tokens`` long.
        hot_median_tokens: lognormal length of a hot prompt.
    """

    rate_per_s: float = 10.0
    templates: int = 3
    template_tokens: int = 600
    doc_median_tokens: float = 2500.0
    hot_share: float = 0.3
    hot_prompts: int = 200
    hot_median_tokens: float = 2000.0


@dataclass(frozen=True)
class CycleParams:
    """A working set requested round-robin.

    Attributes:
        rate_per_s: requests per second (evenly spaced).
        prompts: prompts in the working set.
        prompt_tokens: tokens of each prompt (all distinct after a shared system prompt).
        system_tokens: tokens of the system prompt every prompt starts with.
        jitter: each cycle's order is the previous one with this share of neighbours swapped.
    """

    rate_per_s: float = 5.0
    prompts: int = 300
    prompt_tokens: int = 4000
    system_tokens: int = 512
    jitter: float = 0.1


REGIMES: dict[str, type] = {"chat": ChatParams, "agent": AgentParams, "rag": RagParams,
                            "batch": BatchParams, "cycle": CycleParams}


class SynthError(ValueError):
    """Bad generator parameters; the message names the parameter and the fix."""


def make_params(regime: str, overrides: dict[str, str]) -> Any:
    """The parameter object of ``regime`` with ``overrides`` (strings, converted to the field type).

    Raises:
        SynthError: unknown regime or parameter, unparsable or out-of-range value.
    """
    cls = REGIMES.get(regime)
    if cls is None:
        raise SynthError(f"unknown regime {regime!r}; choose one of {', '.join(REGIMES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, text in overrides.items():
        if name not in fields:
            raise SynthError(f"regime {regime} has no parameter {name!r}; its parameters are {', '.join(fields)}")
        kind: Any = type(fields[name].default)
        try:
            values[name] = kind(text)
        except ValueError:
            raise SynthError(f"parameter {name} of regime {regime} must be {kind.__name__}, got {text!r}") from None
    params = cls(**values)
    for name in fields:
        value = getattr(params, name)
        high = _maximum(name)
        most = f"{int(high):,}" if float(high).is_integer() else f"{high:g}"
        if name.endswith("share") or name == "jitter":
            ok, rule = 0 <= value <= 1, "between 0 and 1"
        elif name == "mean_turns":
            ok, rule = 2 <= value <= high, f"at least 2 and at most {most}"
        elif name == "rate_per_s":  # a mean gap past the longest think time wrote timestamps of 300 digits
            ok, rule = MIN_RATE_PER_S <= value <= high, f"at least {MIN_RATE_PER_S:.2g} (one per 30 days) and at most {most}"
        else:
            ok, rule = 0 < value <= high, f"positive and at most {most}"
        if not ok:  # NaN fails every comparison, infinity the upper bound
            raise SynthError(f"parameter {name} of regime {regime} must be {rule}, got {value}")
    return params


MIN_RATE_PER_S = 1 / (30 * 86_400.0)
"""Slowest arrival rate a regime accepts, per second: one per 30 days, the bound of think and tool times."""


def _maximum(name: str) -> float:
    """Largest accepted value of parameter ``name``: far past any real traffic, small enough that a
    typo cannot make the generator run for hours or fill the memory."""
    if name.endswith("_tokens"):
        return 1_000_000
    if name.endswith("sigma"):
        return 4.0
    if name == "zipf_s":
        return 10.0
    if name == "rate_per_s":
        return 100_000.0
    if name.endswith("_s"):  # think and tool times
        return 30 * 86_400.0
    if name in ("mean_turns", "mean_steps"):
        return 1_000.0
    return 1_000_000  # counts: system prompts, agents, documents, templates, hot prompts, prompts
