"""What differs between engines on the HTTP side (their "flavour"), and the pure parsing of their
Prometheus ``/metrics`` page into load figures. No I/O here: the adapter fetches, this reads."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# Engine flavours: what differs between vLLM and SGLang on the HTTP side
# ---------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class EngineFlavor:
    name: str
    running: tuple[str, ...]  # Prometheus gauges (summed over label sets: one per engine / DP rank)
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # fraction 0..1 (averaged over label sets)
    cache_info: str | None  # info gauge with block_size / num_gpu_blocks / enable_prefix_caching labels
    return_token_ids: bool  # the completions API streams the generated token ids when asked
    hints: str = ""  # what the engine's command line needs, for log messages
    #: a server without ``/metrics`` (404) is still healthy: load then comes from in-flight accounting
    metrics_optional: bool = False
    #: the server's ``max_model_len`` bounds what routing sends it: our token counts are its own (we send
    #: token ids). Not for a relay (``openai``): its prompts are counted by an estimate, which would refuse
    #: requests the server takes
    states_limits: bool = True
    #: every model the server lists in ``/v1/models`` is a name it serves (routing sends a request naming one only
    #: to the servers listing it: a fleet of several models); else only its LoRA adapters (``parent`` set) are
    #: (vLLM / SGLang: one base model per fleet, ThunderAgent's ``model``)
    lists_models: bool = False
    #: a gauge with one sample per ``sleep_state`` label, ``awake`` 1 or 0 (vLLM's sleep mode; None: not read)
    sleep_state: str | None = None
    #: a GET path answering ``{"is_paused": bool}`` (vLLM's ``/is_paused``, served in its dev mode: the only place a
    #: pause sent to the server shows; no metric says it), read with every load poll while it answers (None: not read)
    pause_state: str | None = None
    #: the server's own KV pulls from other servers, cumulative (vLLM's NIXL connector: its histograms' byte and
    #: second sums and their count, on the reading side: a decode server): (bytes, seconds, transfers) metric names
    kv_pulls: tuple[str, str, str] | None = None
    #: the prompt tokens its requests computed (cached ones not counted) and the seconds they spent in prefill,
    #: cumulative (vLLM's per-request histograms' sums): its measured prefill rate (metric names; None: not read)
    prefill: tuple[str, str] | None = None

    @property
    def wanted(self) -> frozenset[str]:
        names = {*self.running, *self.waiting, *self.kv_usage, *(self.kv_pulls or ()), *(self.prefill or ()),
                 "process_start_time_seconds"}
        if self.sleep_state:
            names.add(self.sleep_state)
        if self.cache_info:
            names.add(self.cache_info)
        return frozenset(names)


VLLM = EngineFlavor(
    "vllm",
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # current, before 0.10
    cache_info="vllm:cache_config_info",
    return_token_ids=True,
    hints="--enable-prefix-caching --enable-prompt-tokens-details --block-size N --kv-events-config ...",
    sleep_state="vllm:engine_sleep_state",
    pause_state="/is_paused",
    kv_pulls=("vllm:nixl_bytes_transferred_sum", "vllm:nixl_xfer_time_seconds_sum",
              "vllm:nixl_xfer_time_seconds_count"),
    prefill=("vllm:request_prefill_kv_computed_tokens_sum", "vllm:request_prefill_time_seconds_sum"),
)


# ---------------------------------------------------------------------------------------------
# Prometheus text (pure)
# ---------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str, wanted: frozenset[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of the ``wanted`` metrics: name -> [(labels, value)]. Other lines are skipped
    without parsing their labels (vLLM's page is mostly histograms we do not need)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        if line[:name_end] not in wanted:
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


@dataclass(slots=True, frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    prefix_caching: bool | None = None
    start_time: float | None = None
    asleep: bool | None = None  # the server sleeps (vLLM: ``awake`` 0 on any engine); None: the page does not say
    #: its KV pulls so far (bytes, seconds, transfers: :attr:`EngineFlavor.kv_pulls`); None: the page has none
    kv_pulls: tuple[float, float, float] | None = None
    #: its requests' computed prompt tokens and prefill seconds so far (:attr:`EngineFlavor.prefill`); None: not said
    prefill: tuple[float, float] | None = None


def engine_stats(text: str, flavor: EngineFlavor, engine: str | None = None) -> EngineStats:
    """The load figures of ``text`` (a ``/metrics`` page); ``engine``: one data-parallel rank's (vLLM labels each
    engine's samples ``engine="RANK"``; samples without the label, e.g. the process start time, are the server's)."""
    m = parse_prometheus(text, flavor.wanted)
    if engine is not None:
        m = {name: [(labels, v) for labels, v in samples if labels.get("engine", engine) == engine]
             for name, samples in m.items()}

    def first(names: tuple[str, ...]) -> list[float]:
        for n in names:
            if n in m:
                return [v for _, v in m[n]]
        return []

    def sums(names: tuple[str, ...] | None) -> tuple[float, ...] | None:
        """Each metric summed over its label sets, when the page has them all (None: it does not say)."""
        if names is None or not all(n in m for n in names):
            return None
        return tuple(sum(v for _, v in m[name]) for name in names)

    usage = first(flavor.kv_usage)
    block_size = num_blocks = None
    prefix = None
    if flavor.cache_info and flavor.cache_info in m:
        labels = m[flavor.cache_info][0][0]
        with contextlib.suppress(ValueError, KeyError):
            block_size = int(labels["block_size"])
        with contextlib.suppress(ValueError, KeyError):
            num_blocks = int(labels["num_gpu_blocks"])
        if "enable_prefix_caching" in labels:
            prefix = labels["enable_prefix_caching"] == "True"
    start = m.get("process_start_time_seconds")
    awake = [v for labels, v in m.get(flavor.sleep_state or "", ()) if labels.get("sleep_state") == "awake"]
    return EngineStats(
        running=int(sum(first(flavor.running))),
        waiting=int(sum(first(flavor.waiting))),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        block_size=block_size,
        num_blocks=num_blocks,
        prefix_caching=prefix,
        start_time=start[0][1] if start else None,
        asleep=any(v == 0 for v in awake) if awake else None,
        kv_pulls=sums(flavor.kv_pulls),  # type: ignore[arg-type]  # three names, three sums
        prefill=sums(flavor.prefill),  # type: ignore[arg-type]  # two names, two sums
    )
