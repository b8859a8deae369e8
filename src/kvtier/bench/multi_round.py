"""``multi-round``: sessions that each grow a conversation over several turns, with think time.

Turn ``r`` of session ``s`` sends the whole conversation so far (the pattern of chat and agent
traffic, and of LMCache's ``multi_round_qa`` benchmark)::

    [ system (shared by all sessions) | q(s,0) a(s,0) | q(s,1) a(s,1) | ... | q(s,r) ]

``a(s,k)`` is a deterministic stand-in answer of ``answer_len`` tokens, not the server's real
output, so the workload is the same on every run and every arm; the server still generates
``answer_len`` tokens per turn.  Turn ``r+1`` is sent ``think_time_s`` after turn ``r`` finished;
sessions start ``session_interval_s`` apart and run concurrently.
"""

from __future__ import annotations

from kvtier.bench.workload import (
    DOMAIN_ANSWER,
    DOMAIN_QUESTION,
    DOMAIN_SYSTEM,
    BenchRequest,
    TokenSpace,
    Workload,
    WorkloadError,
    check_at_least,
)

MAX_WAIT_S = 3600.0
"""Longest ``--think-time`` and ``--session-interval`` accepted, seconds (an hour: longer waits are
not a benchmark; inf hung the run)."""


def check_multi_round(*, num_sessions: int, num_rounds: int, system_len: int, question_len: int, answer_len: int,
                      think_time_s: float, session_interval_s: float) -> None:
    """Check the knobs of :func:`multi_round_workload` (same meanings) without building it.

    Raises:
        WorkloadError: a knob is out of range.
    """
    check_at_least((("--num-sessions", num_sessions, 1), ("--num-rounds", num_rounds, 1),
                    ("--system-len", system_len, 0), ("--question-len", question_len, 1),
                    ("--answer-len", answer_len, 1)))
    if not (0 <= think_time_s <= MAX_WAIT_S and 0 <= session_interval_s <= MAX_WAIT_S):  # nan fails too
        raise WorkloadError(f"--think-time and --session-interval are seconds and must be from 0 to {MAX_WAIT_S:,.0f} "
                            f"(an hour), got {think_time_s} and {session_interval_s}")


def multi_round_workload(tokens: TokenSpace, *, num_sessions: int = 8, num_rounds: int = 4,
                         system_len: int = 512, question_len: int = 128, answer_len: int = 64,
                         think_time_s: float = 1.0, session_interval_s: float = 0.5) -> Workload:
    """Build the workload; requests are listed session by session, turn by turn.

    Raises:
        WorkloadError: a knob is out of range.
    """
    check_multi_round(num_sessions=num_sessions, num_rounds=num_rounds, system_len=system_len,
                      question_len=question_len, answer_len=answer_len, think_time_s=think_time_s,
                      session_interval_s=session_interval_s)
    system = tokens.block(DOMAIN_SYSTEM, (0,), system_len)
    requests = []
    for s in range(num_sessions):
        history: tuple[int, ...] = system
        # turn 0 shares the system prompt with earlier sessions; turn r > 0 shares the previous
        # turn's whole prompt (the stand-in answer after it was never sent, so it is not shared)
        shared = system_len if s > 0 else 0
        for r in range(num_rounds):
            prompt = history + tokens.block(DOMAIN_QUESTION, (s, r), question_len)
            requests.append(BenchRequest(
                request_id=f"session-{s}-turn-{r}", prompt_token_ids=prompt, max_tokens=answer_len,
                arrival_s=s * session_interval_s, session=f"session-{s}",
                think_time_s=think_time_s if r > 0 else 0.0, shared_prefix_tokens=shared))
            history = prompt + tokens.block(DOMAIN_ANSWER, (s, r), answer_len)
            shared = len(prompt)
    params: dict[str, object] = {
        "num_sessions": num_sessions, "num_rounds": num_rounds, "system_len": system_len,
        "question_len": question_len, "answer_len": answer_len, "think_time_s": think_time_s,
        "session_interval_s": session_interval_s, "seed": tokens.seed}
    return Workload(name="multi-round", params=params, requests=tuple(requests))
