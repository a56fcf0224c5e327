"""Real KV bytes for simulated workers: their config fields act or are refused, the plane learns a
link from a pull's own duration and starts from probed links, a pull's report crosses the wire."""

from __future__ import annotations

import json

import pytest

from thunderagent.bus import wire
from thunderagent.config import ConfigError, KvTransferConfig, parse_config
from thunderagent.config.transfer import LinkEstimate
from thunderagent.execution.factories import fleet_plane, sim_block_bytes
from thunderagent.execution.kv_bytes_worker import byte_source
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import KvPull, KvTransfer, TokenOutput


def cfg(plane: dict[str, object], engine: str = "simulated") -> object:
    prefill: dict[str, object] = {"role": "prefill", "kv_cache_transfer": {"enabled": True, **plane}}
    decode: dict[str, object] = {"role": "decode"}
    top: dict[str, object] = {}
    if engine != "simulated":
        real = {"engine": engine, "endpoints": [{"url": "http://127.0.0.1:1"}]}
        prefill |= real
        decode |= {**real, "endpoints": [{"url": "http://127.0.0.1:2"}]}
        top["model"] = "/tmp"
    return parse_config({**top, "execution_group": {"nodes": [prefill, decode]}}, "t")


def test_block_bytes_default_to_what_the_plane_charges_and_zero_turns_bytes_off():
    c = cfg({})
    plane = fleet_plane(c)  # type: ignore[arg-type]
    assert plane is not None and sim_block_bytes(plane, 64) == 131072 * 64
    assert sim_block_bytes(cfg({"sim_block_bytes": 0}).execution_group.nodes[0].kv_cache_transfer, 64) == 0  # type: ignore[attr-defined]
    assert fleet_plane(parse_config({}, "t")) is None  # no prefill group: nothing moves


@pytest.mark.parametrize("field", [{"sim_block_bytes": 1024}, {"sim_host": "0.0.0.0"},
                                   {"sim_faults": {"corrupt_p": 0.5}}])
def test_sim_fields_are_refused_without_the_plane_or_on_a_real_engine(field):
    with pytest.raises(ValueError, match="kv_cache_transfer.enabled"):
        KvTransferConfig(**field)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="simulated workers. KV bytes; engine vllm"):
        cfg(field, engine="vllm")


@pytest.mark.parametrize(("bad", "where"), [
    ({"sim_block_bytes": -1}, "sim_block_bytes"), ({"sim_host": ""}, "sim_host"),
    ({"sim_faults": {"interrupt_p": 1.5}}, "interrupt_p"), ({"sim_faults": {"slow_link_bps": 0}}, "slow_link_bps"),
    ({"sim_faults": {"oops": 1}}, "oops"),
    ({"links": [{"src": "a", "dst": "b", "bandwidth_gbps": 0, "latency_s": 0}]}, "bandwidth_gbps"),
])
def test_bad_values_name_their_field(bad, where):
    with pytest.raises(ConfigError, match=where):
        cfg(bad)


def test_probed_links_seed_the_plane_and_a_pull_teaches_its_link():
    c = KvTransferConfig(enabled=True, bandwidth_gbps=8.0, latency_s=0.0, ewma_alpha=0.5,
                         links=(LinkEstimate(src="p", dst="d", bandwidth_gbps=16.0, latency_s=0.001),))
    p = TransferPlane(c)
    assert p.estimate("p", "d", 2 * 10**9) == pytest.approx(1.001)  # probed: 2 GB/s
    assert p.estimate("p", "x", 10**9) == pytest.approx(1.0)  # unprobed: the default
    p.learn("p", "d", 10**9, 1.001)  # the pull measured 1 GB/s (latency taken off)
    assert p.links[("p", "d")].bandwidth_bps == pytest.approx(1.5e9) and p.links[("p", "d")].samples == 1
    p.learn("p", "d", 10**9, 0.0005)  # shorter than the latency: nothing to learn
    assert p.links[("p", "d")].samples == 1


def test_a_pull_report_crosses_the_wire():
    outs = [TokenOutput("r", [1], 0.5, 3, 3, kv_pull=KvPull("ok", 4096, 2, 0.25)),
            TokenOutput("r", [], 0.5, 3, 0, True, "unavailable", kv_pull=KvPull("kv_checksum", 0, 0, 0.1))]
    batch = wire.decode_tokens(wire.encode(wire.TokenBatch(1, [wire.output_to_wire(o) for o in outs])))
    assert [wire.output_from_wire("r", w) for w in batch.outputs] == outs


def test_byte_source_reads_only_a_simulated_workers_transfer():
    params = json.dumps({"kv_bytes": ["127.0.0.1", 4000], "block_bytes": 512})
    assert byte_source(KvTransfer("p", 64, (1,), params)) == ("127.0.0.1", 4000, 512, None)  # the pull's own id
    keyed = json.dumps({"kv_bytes": ["127.0.0.1", 4000], "block_bytes": 512, "transfer": "migrate-1-source"})
    assert byte_source(KvTransfer("p", 64, (1,), keyed)) == ("127.0.0.1", 4000, 512, "migrate-1-source")
    assert byte_source(KvTransfer("p", 64, (1,), "[1, 2]")) is None  # not a map
    assert byte_source(KvTransfer("p", 64, (), params)) is None  # nothing to move
    assert byte_source(KvTransfer("p", 64, (1,), '{"remote_engine_id": "x"}')) is None  # vLLM's
    assert byte_source(KvTransfer("p", 64, (1,), None)) is None and byte_source(None) is None


def test_a_pulls_timeout_follows_its_probed_link_with_a_floor():
    from thunderagent.execution.kv_bytes_worker import MIN_PULL_TIMEOUT_S, KvBytesWorker

    plane = KvTransferConfig(enabled=True, bandwidth_gbps=8.0, latency_s=0.0, timeout_factor=4.0,
                             links=(LinkEstimate(src="p", dst="d", bandwidth_gbps=0.8, latency_s=0.5),))
    w = KvBytesWorker.__new__(KvBytesWorker)  # the timeout reads the plane and the worker id only
    w.plane, w.worker_id = plane, "d"
    assert w._timeout("p", 10**9) == pytest.approx(4 * (10 + 0.5))  # the probed link: 0.1 GB/s
    assert w._timeout("q", 10**9) == pytest.approx(4 * 1.0)  # no probe: the default 1 GB/s
    assert w._timeout("p", 0) == MIN_PULL_TIMEOUT_S  # never under the floor


def test_cli_refuses_bad_endpoints_and_live_only_fields_in_the_simulator(tmp_path):
    from typer.testing import CliRunner

    from thunderagent.cli import app

    run = CliRunner().invoke
    assert "NAME=HOST:PORT" in run(app, ["probe-links", "--endpoint", "p0=127.0.0.1"]).output
    one = run(app, ["probe-links", "--endpoint", "p0=127.0.0.1:5000", "--endpoint", "p0=127.0.0.1:5001"])
    assert one.exit_code == 2 and "two or more" in one.output
    cfg = tmp_path / "c.yaml"
    cfg.write_text("execution_group: {nodes: [{role: prefill, kv_cache_transfer: {enabled: true, "
                   "sim_faults: {corrupt_p: 1.0}}}, {role: decode}]}\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 128, "output_length": 4, "hash_ids": [1]}\n')
    res = run(app, ["sim", "--trace", str(trace), "--config", str(cfg), "--pd", "1:1"])
    assert res.exit_code == 2 and "kv_cache_transfer.sim_faults acts on a live server" in res.output
    strict = tmp_path / "strict.yaml"
    strict.write_text("execution_group: {nodes: [{role: prefill, kv_cache_transfer: {enabled: true}}, "
                      "{role: decode}]}\nrouting: {fallback_to_local: false, disaggregation: {mode: always}}\n")
    # strict disaggregation is simulated with prefill and decode workers in mode always only
    for args in ([], ["--pd", "1:1", "--pd-mode", "conditional"]):
        res = run(app, ["sim", "--trace", str(trace), "--config", str(strict), *args])
        assert res.exit_code == 2 and "strict disaggregation) needs --pd P:D" in res.output, args
    res = run(app, ["sim", "--trace", str(trace), "--config", str(strict), "--pd", "1:1", "--policy", "kv_aware"])
    assert res.exit_code == 0, res.output


def test_a_real_engine_config_dumped_and_read_again_is_accepted() -> None:
    """A deployment file written from a Config names every field at its default: the simulated byte
    fields must not count as set then (the NATS tests write their workers' config that way)."""
    cfg = parse_config({"model": "/tmp/m", "execution_group": {"nodes": [{
        "engine": "vllm", "endpoints": [{"url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2"}]}]}})
    again = parse_config(cfg.model_dump(mode="json"))
    assert again.execution_group.nodes[0].kv_cache_transfer == cfg.execution_group.nodes[0].kv_cache_transfer
