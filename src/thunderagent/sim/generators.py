"""Synthetic workloads, as :class:`~thunderagent.sim.traces.TraceRequest` lists like the loaders'.

Every generator is deterministic for its ``seed`` (one private ``random.Random``) and describes
prompts as **content blocks** of ``block_size`` tokens (default 64) with dense ids allocated in
order of first appearance, exactly like a loaded trace; ``TraceRequest.tokens()`` expands them.
Shared content (a group's prefix, a conversation's history, the agents' common tool/system prompt)
is therefore made of whole blocks: its lengths are rounded **up** to a multiple of ``block_size``.
Only the final segment of a prompt (a unique suffix / the new user text / the new tool result) may
end inside a block, and, since each turn's history is rebuilt from whole blocks, lengths that later
become history (user text, outputs, tool results) are rounded up too. Arrival times are seconds
from the first arrival (which is 0).

Length arguments accept an ``int`` (fixed) or a ``(lo, hi)`` tuple (uniform integer, inclusive).

* :func:`shared_prefix` - ``G`` groups, each with a common system prefix of ``P`` tokens; each
  request = its group's prefix + a unique suffix; Poisson arrivals at ``rate`` req/s; group drawn
  uniformly. ``session`` = None (independent requests).
* :func:`zipf_prefix` - like :func:`shared_prefix`, but the prefix is drawn with Zipf popularity
  (prefix ``k`` of ``N`` with probability proportional to ``(k + 1) ** -alpha``): a few hot prefixes
  draw most of the traffic (issue 9's hot-prefix workload: 64 prefixes of 2,048 tokens, alpha 1.1).
* :func:`multi_turn_chat` - ``C`` conversations of ``T`` turns; conversations start as a Poisson
  process at ``conversation_rate``; turn k+1's prompt = turn k's prompt + turn k's output + new
  user text; turn k+1 arrives an exponential ``think_time_s`` (mean) after turn k (open loop: the
  gap stands for response time plus user think time). ``session`` = ``"chat-<c>"``.
* :func:`agent_programs` - like chat, for agent trajectories: ``session`` = ``"program-<p>"`` (the
  program id), a tool/system prompt shared by **all** programs, a task description, then per step
  the model's output (a tool call) and a tool result appended; steps separated by a tool pause
  drawn from a log-normal distribution (``tool_pause_median_s``, ``tool_pause_sigma``); contexts
  grow long (tens of thousands of tokens with the defaults).
* :func:`fleet_traffic` - chat or agent traffic scaled to a fleet's size (``thunderagent sim
  --generate``): the same load per worker at any number of workers.
* :func:`rollout_groups` - RL rollout groups: ``G`` groups arrive as a Poisson process at ``group_rate``;
  the ``N`` programs of a group all start at the group's arrival with the same prompt (a system prompt
  shared by every program + the group's task), then diverge as agent programs do (their own outputs
  and tool results, log-normal tool pauses). ``session`` = ``"rollout-<g>-<m>"``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from thunderagent.sim.traces import PAD_BASE, TraceRequest

__all__ = ["FLEET_TRAFFIC", "agent_programs", "fleet_traffic", "multi_turn_chat", "ramp", "rollout_groups",
           "shared_prefix", "zipf_prefix"]

Length = int | tuple[int, int]


def _draw(rng: random.Random, spec: Length, name: str, minimum: int = 0) -> int:
    if isinstance(spec, tuple):
        lo, hi = spec
        if lo > hi:
            raise ValueError(f"{name}: empty range {spec}")
        v = rng.randint(lo, hi)
    else:
        v = spec
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def _check(block_size: int, **counts: float) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    for k, v in counts.items():
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")


class _Blocks:
    """Dense content-block id allocator."""

    __slots__ = ("bs", "next")

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.next = 0

    def new(self, tokens: int) -> list[int]:
        """Fresh ids covering ``tokens`` tokens (the last block possibly partial)."""
        n = -(-tokens // self.bs)
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def whole(self, tokens: int) -> int:
        """``tokens`` rounded up to whole blocks."""
        return -(-tokens // self.bs) * self.bs


def _finish(reqs: list[TraceRequest]) -> list[TraceRequest]:
    reqs.sort(key=lambda r: r.arrival_s)  # stable: generation order breaks ties
    t0 = reqs[0].arrival_s if reqs else 0.0
    for k, r in enumerate(reqs):
        r.arrival_s -= t0
        r.pad_token = PAD_BASE + k
    return reqs


def shared_prefix(
    num_groups: int,
    prefix_tokens: int,
    suffix_tokens: Length,
    num_requests: int,
    rate: float,
    output_tokens: Length = 128,
    *,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """``num_requests`` requests, each = one of ``num_groups`` shared prefixes (``prefix_tokens``,
    rounded up to whole blocks) + a unique suffix of ``suffix_tokens`` (≥ 1); Poisson arrivals at
    ``rate`` req/s (first at 0); group drawn uniformly."""
    _check(block_size, num_groups=num_groups, prefix_tokens=prefix_tokens, num_requests=num_requests)
    if num_groups == 0 and num_requests:
        raise ValueError("num_groups must be > 0")
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    return _prefixed(rng, num_groups, prefix_tokens, suffix_tokens, num_requests, rate, output_tokens, block_size,
                     lambda: rng.randrange(num_groups), lambda i, g: f"sp:{i}")


def zipf_prefix(
    num_prefixes: int,
    prefix_tokens: int,
    suffix_tokens: Length,
    num_requests: int,
    rate: float,
    output_tokens: Length = 128,
    *,
    alpha: float = 1.1,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """``num_requests`` requests, each = one of ``num_prefixes`` shared prefixes (``prefix_tokens``,
    rounded up to whole blocks) + a unique suffix of ``suffix_tokens`` (>= 1); Poisson arrivals at
    ``rate`` req/s (first at 0). Prefix ``k`` (0-based) is drawn with probability proportional to
    ``(k + 1) ** -alpha``: prefix 0 is the hottest. Request ids are ``zp:<i>:p<k>``."""
    _check(block_size, num_prefixes=num_prefixes, prefix_tokens=prefix_tokens, num_requests=num_requests,
           alpha=alpha)
    if num_prefixes == 0 and num_requests:
        raise ValueError("num_prefixes must be > 0")
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    cum: list[float] = []
    total = 0.0
    for k in range(num_prefixes):
        total += (k + 1) ** -alpha
        cum.append(total)
    ranks = range(num_prefixes)
    return _prefixed(rng, num_prefixes, prefix_tokens, suffix_tokens, num_requests, rate, output_tokens, block_size,
                     lambda: rng.choices(ranks, cum_weights=cum)[0], lambda i, g: f"zp:{i}:p{g}")


def _prefixed(rng: random.Random, num_prefixes: int, prefix_tokens: int, suffix_tokens: Length, num_requests: int,
              rate: float, output_tokens: Length, block_size: int, pick: Callable[[], int],
              name: Callable[[int, int], str]) -> list[TraceRequest]:
    """Poisson arrivals of one of ``num_prefixes`` shared prefixes (``pick`` draws which) + a unique suffix."""
    blocks = _Blocks(block_size)
    plen = blocks.whole(prefix_tokens)
    prefixes = [blocks.new(plen) for _ in range(num_prefixes)]
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate)
        g = pick()
        s = _draw(rng, suffix_tokens, "suffix_tokens", 1)
        o = _draw(rng, output_tokens, "output_tokens")
        out.append(TraceRequest(name(i, g), t, plen + s, o, prefixes[g] + blocks.new(s), block_size, None))
    return _finish(out)


def multi_turn_chat(
    num_conversations: int,
    turns: int,
    *,
    conversation_rate: float = 1.0,
    system_tokens: int = 0,
    user_tokens: Length = (64, 512),
    output_tokens: Length = (64, 512),
    think_time_s: float = 10.0,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """``num_conversations`` chats of ``turns`` turns each (see the module docstring).

    Turn 0 = the system prompt (``system_tokens``, shared by all conversations, 0 for none) + user
    text; turn k+1 = turn k's prompt + turn k's output + new user text. User text and outputs are
    whole blocks (rounded up), so each turn's prompt extends the previous one block for block.
    ``think_s`` of turn k+1 records the drawn gap."""
    _check(block_size, num_conversations=num_conversations, turns=turns, system_tokens=system_tokens)
    if conversation_rate <= 0 or think_time_s < 0:
        raise ValueError("conversation_rate must be > 0 and think_time_s >= 0")
    rng = random.Random(seed)
    blocks = _Blocks(block_size)
    system = blocks.new(blocks.whole(system_tokens))
    out: list[TraceRequest] = []
    start = 0.0
    for c in range(num_conversations):
        if c:
            start += rng.expovariate(conversation_rate)
        ids = list(system)
        t = start
        think: float | None = None
        for k in range(turns):
            u = blocks.whole(_draw(rng, user_tokens, "user_tokens", 1))
            ids = ids + blocks.new(u)
            o = blocks.whole(_draw(rng, output_tokens, "output_tokens", 1))
            out.append(TraceRequest(f"chat-{c}:{k}", t, len(ids) * block_size, o, ids, block_size, f"chat-{c}", think))
            ids = ids + blocks.new(o)  # the answer becomes history of the next turn
            think = rng.expovariate(1.0 / think_time_s) if think_time_s > 0 else 0.0
            t += think
    return _finish(out)


def agent_programs(
    num_programs: int,
    steps: int,
    *,
    program_rate: float = 0.2,
    shared_tokens: int = 8192,
    task_tokens: Length = (512, 2048),
    tool_result_tokens: Length = (256, 8192),
    output_tokens: Length = (64, 512),
    tool_pause_median_s: float = 2.0,
    tool_pause_sigma: float = 1.0,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """``num_programs`` agent trajectories of ``steps`` LLM calls each (see the module docstring).

    Step 0 = shared tool/system prompt (``shared_tokens``, common to every program) + task
    description; step k+1 = step k's prompt + step k's output (the tool call) + the tool result.
    Programs start as a Poisson process at ``program_rate``; step k+1 arrives after a tool pause
    ``lognormvariate(ln(tool_pause_median_s), tool_pause_sigma)`` (recorded in ``think_s``). All
    history segments are whole blocks."""
    _check(block_size, num_programs=num_programs)
    if program_rate <= 0:
        raise ValueError("program_rate must be > 0")
    return _programs(num_programs, 1, steps, program_rate, shared_tokens, task_tokens, tool_result_tokens,
                     output_tokens, tool_pause_median_s, tool_pause_sigma, seed, block_size, lambda g, m: f"program-{g}")


def _programs(num_groups: int, group_size: int, steps: int, rate: float, shared_tokens: int, task_tokens: Length,
              tool_result_tokens: Length, output_tokens: Length, tool_pause_median_s: float, tool_pause_sigma: float,
              seed: int, block_size: int, session: Callable[[int, int], str]) -> list[TraceRequest]:
    """Groups of agent programs arriving as a Poisson process at ``rate``; the programs of a group start
    together on the shared prompt + the group's task, then each runs :func:`_trajectory`."""
    _check(block_size, group_size=group_size, steps=steps, shared_tokens=shared_tokens)
    if tool_pause_median_s <= 0 or tool_pause_sigma < 0:
        raise ValueError("tool_pause_median_s must be > 0, tool_pause_sigma >= 0")
    rng = random.Random(seed)
    blocks = _Blocks(block_size)
    shared = blocks.new(blocks.whole(shared_tokens))
    mu = math.log(tool_pause_median_s)
    out: list[TraceRequest] = []
    start = 0.0
    for g in range(num_groups):
        if g:
            start += rng.expovariate(rate)
        prompt = shared + blocks.new(blocks.whole(_draw(rng, task_tokens, "task_tokens", 1)))
        for m in range(group_size):
            _trajectory(rng, blocks, out, session(g, m), prompt, start, steps, output_tokens, tool_result_tokens, mu,
                        tool_pause_sigma)
    return _finish(out)


def _trajectory(rng: random.Random, blocks: _Blocks, out: list[TraceRequest], session: str, ids: list[int],
                t: float, steps: int, output_tokens: Length, tool_result_tokens: Length, mu: float,
                sigma: float) -> None:
    """One agent program's ``steps`` requests into ``out``, from prompt ``ids`` at time ``t``: each step's
    prompt is the last one + its output (the tool call) + a tool result, after a log-normal tool pause."""
    bs = blocks.bs
    pause: float | None = None
    for k in range(steps):
        o = blocks.whole(_draw(rng, output_tokens, "output_tokens", 1))
        out.append(TraceRequest(f"{session}:{k}", t, len(ids) * bs, o, ids, bs, session, pause))
        r = blocks.whole(_draw(rng, tool_result_tokens, "tool_result_tokens", 1))
        ids = ids + blocks.new(o) + blocks.new(r)
        pause = rng.lognormvariate(mu, sigma)
        t += pause


def rollout_groups(
    num_groups: int,
    group_size: int,
    steps: int,
    *,
    group_rate: float = 0.05,
    shared_tokens: int = 1024,
    task_tokens: Length = 4096,
    tool_result_tokens: Length = (128, 1024),
    output_tokens: Length = (128, 512),
    tool_pause_median_s: float = 2.0,
    tool_pause_sigma: float = 1.0,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """``num_groups`` rollout groups of ``group_size`` programs of ``steps`` LLM calls each (see the module
    docstring). Step 0 of every program of group ``g`` = the shared system prompt (``shared_tokens``) + the
    group's task (``task_tokens``, drawn once per group); step k+1 = step k's prompt + its output + a tool
    result, after a log-normal tool pause (recorded in ``think_s``). All history segments are whole blocks."""
    _check(block_size, num_groups=num_groups)
    if group_rate <= 0:
        raise ValueError("group_rate must be > 0")
    return _programs(num_groups, group_size, steps, group_rate, shared_tokens, task_tokens, tool_result_tokens,
                     output_tokens, tool_pause_median_s, tool_pause_sigma, seed, block_size,
                     lambda g, m: f"rollout-{g}-{m}")


def ramp(
    num_groups: int,
    prefix_tokens: int,
    suffix_tokens: Length,
    peak_rate: float,
    *,
    base_rate: float,
    ramp_up_s: float,
    hold_s: float,
    ramp_down_s: float,
    output_tokens: Length = 128,
    seed: int = 0,
    block_size: int = 64,
) -> list[TraceRequest]:
    """Load that ramps up, holds and ramps down (the scaling planner's workload): requests like
    :func:`shared_prefix` (one of ``num_groups`` prefixes, drawn uniformly, + a unique suffix), with
    Poisson arrivals whose rate goes linearly from ``base_rate`` to ``peak_rate`` over ``ramp_up_s``,
    stays at ``peak_rate`` for ``hold_s``, and goes back to ``base_rate`` over ``ramp_down_s``
    (thinning of a ``peak_rate`` process). Request ids are ``rp:<i>:g<group>``."""
    _check(block_size, num_groups=num_groups, prefix_tokens=prefix_tokens, base_rate=base_rate, ramp_up_s=ramp_up_s,
           hold_s=hold_s, ramp_down_s=ramp_down_s)
    if num_groups == 0:
        raise ValueError("num_groups must be > 0")
    if not 0 < peak_rate or base_rate > peak_rate:
        raise ValueError(f"need 0 < peak_rate and base_rate <= peak_rate, got {peak_rate} and {base_rate}")
    rng = random.Random(seed)
    blocks = _Blocks(block_size)
    plen = blocks.whole(prefix_tokens)
    prefixes = [blocks.new(plen) for _ in range(num_groups)]
    up_end, hold_end = ramp_up_s, ramp_up_s + hold_s
    end = hold_end + ramp_down_s

    def rate(t: float) -> float:
        if t < up_end:
            return base_rate + (peak_rate - base_rate) * t / up_end
        if t < hold_end:
            return peak_rate
        return peak_rate - (peak_rate - base_rate) * (t - hold_end) / ramp_down_s

    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= end:
            break
        if rng.random() * peak_rate >= rate(t):
            continue
        g = rng.randrange(num_groups)
        s = _draw(rng, suffix_tokens, "suffix_tokens", 1)
        o = _draw(rng, output_tokens, "output_tokens")
        out.append(TraceRequest(f"rp:{len(out)}:g{g}", t, plen + s, o, prefixes[g] + blocks.new(s), block_size, None))
    return _finish(out)


#: the kinds of :func:`fleet_traffic`, with their steps per session
FLEET_TRAFFIC = {"chat": 5, "agents": 10}


def fleet_traffic(kind: str, workers: int, requests_per_worker: int, rate_per_worker: float, *, seed: int = 0,
                  block_size: int = 64) -> list[TraceRequest]:
    """Traffic for a fleet of ``workers``: about ``requests_per_worker * workers`` requests (whole
    sessions of ``FLEET_TRAFFIC[kind]`` steps), sessions starting as a Poisson process at
    ``rate_per_worker * workers / steps`` per second. Once sessions overlap (after one session's
    length: its think times or tool pauses), requests arrive at ``rate_per_worker`` per worker per
    second, so each worker sees the same load whatever the fleet's size (how the router, the index
    and the simulator scale with it is what such runs show). Before that the load ramps up, and
    with few requests per worker a run is mostly that ramp.

    * ``chat``: 5-turn :func:`multi_turn_chat` conversations sharing a 1,024-token system prompt, 256-2,048
      new user tokens and 64-512 output tokens per turn, 20 s mean think time;
    * ``agents``: 10-step :func:`agent_programs` sharing an 8,192-token tool prompt (its defaults otherwise:
      contexts grow to tens of thousands of tokens)."""
    if kind not in FLEET_TRAFFIC:
        raise ValueError(f"traffic kind must be one of {', '.join(FLEET_TRAFFIC)}, got {kind!r}")
    if workers < 1 or requests_per_worker < 1 or not rate_per_worker > 0:
        raise ValueError("workers and requests_per_worker must be >= 1 and rate_per_worker > 0, got "
                         f"{workers}, {requests_per_worker}, {rate_per_worker}")
    steps = FLEET_TRAFFIC[kind]
    sessions = -(-requests_per_worker * workers // steps)
    rate = rate_per_worker * workers / steps
    if kind == "chat":
        return multi_turn_chat(sessions, steps, conversation_rate=rate, system_tokens=1024, user_tokens=(256, 2048),
                               output_tokens=(64, 512), think_time_s=20.0, seed=seed, block_size=block_size)
    return agent_programs(sessions, steps, program_rate=rate, seed=seed, block_size=block_size)
