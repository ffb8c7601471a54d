"""vLLM's CPU build as a bench peer: this file runs inside vLLM's own environment (`make vllm`:
`.peers/vllm`), started by `bench/vllm_peer.py`, and imports nothing of specdec (vLLM pins its own
transformers).

One worker holds one `vllm.LLM` (plain, or with its draft-model or n-gram speculation) and runs
what it is sent: JSON lines on stdin, one answer a line on the stream that was stdout when it
started (vLLM's own logging goes to stderr). A run keeps at most `level` requests in flight
through `LLM.llm_engine` (add a request as one ends, as a server under that many clients would),
all of them given as prompt ids, and answers each request's tokens and timings, with the
engine's iterations (target passes) and draft counts read from vLLM's own metrics.

    {"op": "run", "prompts": [[ids]], "level": n, "max_tokens": m, "temperature": t,
     "top_p": p, "seeds": [s | null], "stop_token_ids": [ids], "reset": bool}
    -> {"ok": true, "wall_seconds": w, "records": [{"tokens", "seconds", "first_token_seconds"}],
        "iterations": i, "drafted": d, "accepted": a}
    {"op": "exit"}
"""

from __future__ import annotations

import json
import os
import sys
import time


def _answer(stream, message: dict) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def _counters(llm) -> dict:
    """vLLM's metrics that a run reports, summed over engines: draft and accepted tokens, and the
    count of the per-iteration token histogram (one iteration: one target pass)."""
    totals = {"iterations": 0, "drafted": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_draft_tokens":
            totals["drafted"] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            totals["accepted"] += int(metric.value)
        elif metric.name == "vllm:iteration_tokens_total":
            totals["iterations"] += int(metric.count)
    return totals


def _reset_proposer(worker) -> None:
    """Run in each of vLLM's workers: a custom proposer with a `reset` (specdec.vllm's) forgets
    what earlier runs taught it."""
    reset = getattr(getattr(worker.model_runner, "drafter", None), "reset", None)
    if callable(reset):
        reset()


def run(llm, message: dict) -> dict:
    """One run: every prompt of `message`, at most `level` in flight -> the answer. With
    `reset`, the proposer forgets earlier runs first (a cross-request cache would otherwise
    hold these prompts' outputs from the last run of them)."""
    from vllm import SamplingParams, TokensPrompt

    if message.get("reset"):
        llm.collective_rpc(_reset_proposer)
    engine = llm.llm_engine
    prompts, level = message["prompts"], int(message["level"])
    seeds = message.get("seeds") or [None] * len(prompts)
    temperature = float(message.get("temperature", 0.0))

    def params(seed):
        return SamplingParams(max_tokens=int(message["max_tokens"]), temperature=temperature,
                              top_p=float(message.get("top_p") or 1.0), seed=seed,
                              stop_token_ids=list(message.get("stop_token_ids") or []), detokenize=False)

    before = _counters(llm)
    records = [{"tokens": [], "seconds": None, "first_token_seconds": None} for _ in prompts]
    admitted: dict[str, tuple[int, float]] = {}
    waiting = list(range(len(prompts)))
    began = time.perf_counter()
    while waiting or admitted:
        while waiting and len(admitted) < level:
            index = waiting.pop(0)
            request_id = f"r{index}"
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompts[index]), params(seeds[index]))
            admitted[request_id] = (index, time.perf_counter())
        for output in engine.step():
            index, start = admitted[output.request_id]
            now = time.perf_counter()
            record = records[index]
            tokens = list(output.outputs[0].token_ids)
            if tokens and record["first_token_seconds"] is None:
                record["first_token_seconds"] = now - start
            record["tokens"] = tokens
            if output.finished:
                record["seconds"] = now - start
                del admitted[output.request_id]
    wall = time.perf_counter() - began
    after = _counters(llm)
    return {"ok": True, "wall_seconds": wall, "records": records,
            **{key: after[key] - before[key] for key in after}}


def main() -> None:
    # this file's folder holds modules named as vLLM's dependencies are (datasets, profile, ...)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM prints goes to stderr; answers go to the saved stdout
    settings = json.loads(sys.argv[1])
    began = time.time()
    try:
        from vllm import LLM

        llm = LLM(model=settings["model"], dtype=settings.get("dtype", "bfloat16"), seed=0,
                  max_model_len=int(settings.get("max_model_len", 4096)),
                  max_num_seqs=int(settings.get("max_num_seqs", 16)), enable_prefix_caching=False,
                  enforce_eager=bool(settings.get("enforce_eager", False)),
                  speculative_config=settings.get("speculative_config"), disable_log_stats=False)
    except Exception as error:  # reported to the bench in one line, which names the peer
        _answer(reply, {"ok": False, "error": f"{type(error).__name__}: {error}"})
        return
    import vllm

    _answer(reply, {"ok": True, "ready": True, "load_seconds": time.time() - began, "vllm": vllm.__version__,
                    "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                                           "LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE")}})
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("op") == "exit":
            break
        try:
            _answer(reply, run(llm, message))
        except Exception as error:
            _answer(reply, {"ok": False, "error": f"{type(error).__name__}: {error}"})


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module: only here does it start
    main()
