"""The vLLM side of align's vLLM runner (align/vllm_engine.py starts it): runs under .venv-vllm's python.

vLLM pins other transformers versions than align, so it lives in its own environment and this script imports only
vllm and the standard library (tests/test_layout.py checks it). It talks JSON lines over its stdin and stdout:

    -> {"model": DIR, "dtype": "float32", "seed": 0, "max_model_len": N | null, "speculative_config": {...} | null,
        "kv_cache_memory_bytes": N}                                           the engine, once
    <- {"ready": true, "vllm": VERSION, "seconds": LOAD_SECONDS}
    -> {"prompts": [[id, ...], ...], "n": 1, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": N, "seed": S,
        "logprobs": K, "stop_token_ids": [...], "one_at_a_time": false}       any number of requests
    <- {"completions": [[{"token_ids": [...], "topk_ids": [[...]], "topk_logprobs": [[...]]}, ...n], ...prompts],
        "seconds": GENERATE_SECONDS, "spec_decode": {"num_drafts": .., "num_draft_tokens": ..,
        "num_accepted_tokens": .., "num_accepted_tokens_per_pos": [...]}}      counters of this request alone
    <- {"error": "one line"}                                                 a request it could not serve

`python align/vllm_worker.py --version` prints the vLLM and speculators versions (launch/setup_vllm.sh's check).
"""

import json
import os
import sys
import time
from importlib import metadata

# Run as a script, Python puts align/ first on sys.path, where align's config.py, data.py, models.py ... would shadow
# top-level modules of the same names for vllm and its dependencies.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

SPEC_DECODE = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "num_accepted_tokens_per_pos",
}


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def spec_decode_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (zeros without a drafter)."""
    counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        name = SPEC_DECODE.get(metric.name)
        if name == "num_accepted_tokens_per_pos":
            counters[name] = list(metric.values)
        elif name:
            counters[name] += metric.value
    return counters


def difference(after: dict, before: dict) -> dict:
    per_pos = [a - (before["num_accepted_tokens_per_pos"][i] if i < len(before["num_accepted_tokens_per_pos"]) else 0)
               for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    return {**{k: after[k] - before[k] for k in after if k != "num_accepted_tokens_per_pos"},
            "num_accepted_tokens_per_pos": per_pos}


def top_k(position_logprobs, k: int) -> tuple[list, list]:
    """The k most likely tokens at one position, best first. vLLM adds the sampled token to its top-k when it is not
    among them (with its own rank, > k), so the entries are ordered by rank and cut at k."""
    ranked = sorted(position_logprobs.items(), key=lambda item: item[1].rank)[:k]
    return [token for token, _ in ranked], [entry.logprob for _, entry in ranked]


def serve_request(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n, k = request["n"], request["logprobs"]

    def params(index: int) -> SamplingParams:
        # vLLM seeds the i-th of n samples of a prompt with seed + i, so prompts are seeds n apart: no two share one.
        seed = None if request["seed"] is None else request["seed"] + index * n
        return SamplingParams(
            n=n, temperature=request["temperature"], top_p=request["top_p"], max_tokens=request["max_new_tokens"],
            seed=seed, logprobs=k or None, stop_token_ids=request["stop_token_ids"], detokenize=False)

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    before = spec_decode_counters(llm)
    start = time.perf_counter()
    if request["one_at_a_time"]:  # batch 1, the latency regime speculative decoding is for
        outputs = [llm.generate([p], params(i), use_tqdm=False)[0] for i, p in enumerate(prompts)]
    else:  # one batch: vLLM schedules it continuously, the throughput regime
        outputs = llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = []
    for output in outputs:
        samples = []
        for sample in sorted(output.outputs, key=lambda s: s.index):
            row = {"token_ids": list(sample.token_ids)}
            if k:
                tops = [top_k(position, k) for position in sample.logprobs]
                row["topk_ids"], row["topk_logprobs"] = [t[0] for t in tops], [t[1] for t in tops]
            samples.append(row)
        completions.append(samples)
    return {"completions": completions, "seconds": seconds,
            "spec_decode": difference(spec_decode_counters(llm), before)}


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        import vllm  # the check is that it imports

        print(f"vllm {vllm.__version__}, speculators {version('speculators')}")
        return
    # The replies go to a private copy of stdout; fd 1 becomes stderr, so that whatever vLLM and its engine process
    # print (vLLM logs to stdout) cannot corrupt them.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    config = json.loads(sys.stdin.readline())
    start = time.perf_counter()
    import vllm
    from vllm import LLM

    from vllm.platforms import current_platform

    optional = {key: config[key] for key in ("max_model_len", "speculative_config") if config.get(key) is not None}
    if current_platform.is_cpu():
        # Unset, vLLM on a CPU reserves 92% of the memory for its KV cache, and refuses to start when less is free.
        # A GPU sizes its cache from free memory (gpu_memory_utilization), as a GPU user expects.
        optional["kv_cache_memory_bytes"] = config["kv_cache_memory_bytes"]
        # A prompt prefilled in pieces over several steps has its seeded generator rewound after each piece, which
        # the CPU's generators cannot do ("CPU Generator does not use offset", vLLM 0.32): 128 seeded samples of one
        # Magpie prefix killed the engine. Whole prefills never rewind.
        optional["enable_chunked_prefill"] = False
    # enforce_eager: compiling took about a minute on a CPU and bought nothing for small models. The prompts arrive
    # as token ids and leave as token ids: no tokenizer is needed, so vLLM's transformers never reads align's.
    # disable_log_stats=False: the speculative-decoding counters live in the stats. generation_config="vllm": every
    # sampling setting comes from the request, none from the model's generation_config.json.
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=config["seed"], enforce_eager=True,
              skip_tokenizer_init=True, disable_log_stats=False, generation_config="vllm", **optional)
    reply({"ready": True, "vllm": vllm.__version__, "seconds": time.perf_counter() - start})
    for line in sys.stdin:
        try:
            reply(serve_request(llm, json.loads(line)))
        except Exception as error:  # a bad request is answered, the engine stays up for the next one
            first_line = (str(error).strip().splitlines() or [""])[0]
            reply({"error": f"{type(error).__name__}: {first_line}"})


if __name__ == "__main__":  # vLLM's engine runs in a spawned child process, which imports this file again
    main()
