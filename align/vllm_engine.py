"""vLLM, driven from align's environment: align never imports vllm.

vLLM pins other transformers versions than align, so it lives in its own environment, `.venv-vllm` at the repository
root (`bash launch/setup_vllm.sh` builds it; `ALIGN_VLLM_PYTHON` names another interpreter). `VllmRunner` starts
align/vllm_worker.py under that interpreter, which loads the model once and then answers requests: prompt token ids
in, completions (and top-k log-probs, and vLLM's speculative-decoding counters) out, as JSON lines over a pipe.

Two uses: `align trajectories` with `trajectories.backend: vllm` (batched sampling, `VllmRunner.generate`), and the
serving check (`serve`: the same prompts greedily at batch 1, with or without a drafter as `speculative_config`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Sequence

from align.config import RecipeError
from align.launch import forget_child, start_child, stop_group

VENV = ".venv-vllm"
WORKER = Path(__file__).with_name("vllm_worker.py")
GIB = 1 << 30


def vllm_python(key: str = "trajectories.backend") -> Path:
    """The interpreter of the vLLM environment: $ALIGN_VLLM_PYTHON, else .venv-vllm's python at the repository root
    (or in the working directory). Missing, it is a one-line RecipeError naming `key`."""
    override = os.environ.get("ALIGN_VLLM_PYTHON")
    if override:
        candidates = [Path(override)]
    else:
        repo = Path(__file__).resolve().parents[1]
        candidates = [repo / VENV / "bin" / "python", Path.cwd() / VENV / "bin" / "python"]
    for python in candidates:
        if python.is_file() and os.access(python, os.X_OK):
            problem = _lacks_vllm(str(python))
            if problem:
                raise RecipeError(f"{key}: {python} {problem}; build vLLM's environment with `bash "
                                  "launch/setup_vllm.sh`, or set ALIGN_VLLM_PYTHON to a python that has vllm")
            return python
    where = f"ALIGN_VLLM_PYTHON={override} is not an executable" if override else f"no {candidates[0]}"
    raise RecipeError(f"{key}: vllm needs vLLM's own environment ({where}); build it with "
                      "`bash launch/setup_vllm.sh`, or set ALIGN_VLLM_PYTHON to a python that has vllm")


@functools.lru_cache(maxsize=None)
def _lacks_vllm(python: str) -> Optional[str]:
    """Why `python` cannot run the worker (None: it can), asked without importing vllm (seconds): it runs, and finds
    vllm on its path. Otherwise the worker would die at its first import, after the stage started."""
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"does not run as a Python interpreter ({type(e).__name__})"
    if done.returncode == 3:
        return "has no vllm installed"
    if done.returncode:
        return f"does not run as a Python interpreter (exit {done.returncode})"
    return None


@dataclass
class Completion:
    """One sampled continuation: token ids (ending with the stop token when one was met) and, when asked for, the
    verifier's k most likely tokens and their log-probs at each position (temperature 1, before sampling's warpers)."""

    token_ids: list[int]
    topk_ids: list[list[int]] = field(default_factory=list)  # (len(token_ids), k)
    topk_logprobs: list[list[float]] = field(default_factory=list)  # (len(token_ids), k)


@dataclass
class Generation:
    completions: list[list[Completion]]  # (prompts, n)
    #: wall time of vLLM's generate alone (no pipe, no load)
    seconds: float
    #: vLLM's speculative-decoding counters for this request: num_drafts, num_draft_tokens, num_accepted_tokens,
    #: num_accepted_tokens_per_pos (zeros without a drafter)
    spec_decode: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for row in self.completions for c in row)


def vllm_dtype(dtype: Any) -> str:
    """vLLM's name for a resolved torch dtype (torch.bfloat16 -> "bfloat16"): what align loaded the model in, never
    vLLM's "auto" (the checkpoint's dtype)."""
    return str(dtype).removeprefix("torch.")


class VllmRunner:
    """A vLLM engine for one model in a worker process; a context manager (closing it ends the worker).

    `dtype` is a name vLLM knows ("float32", "bfloat16", "float16"): pass the resolved one, never "auto" (vLLM's auto
    is the checkpoint's dtype, bf16 for the tiny family, where align's auto is float32 on a CPU). On a CPU vLLM
    reserves `kv_cache_gib` for its KV cache (unset, it takes 92% of the memory, and refuses to start when less is
    free); on a GPU it sizes the cache itself and the setting is ignored.
    """

    def __init__(self, model: str, *, dtype: str, kv_cache_gib: float, seed: int = 0,
                 speculative_config: Optional[dict[str, Any]] = None, max_model_len: Optional[int] = None,
                 cuda_device: Optional[int] = None, key: str = "trajectories.backend") -> None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"VllmRunner: dtype must be resolved (float32, bfloat16, float16), not {dtype!r}")
        python = vllm_python(key)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="align-vllm-", suffix=".log", delete=False)
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        if cuda_device is not None:
            # vLLM takes the first visible GPU: each rank's worker must see its own (cuda:LOCAL_RANK), not GPU 0.
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[cuda_device] if visible else str(cuda_device)
        # In a process group of its own (with vLLM's engine processes): an interrupt of align stops them all.
        self.process = start_child([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=self.log, text=True, env=env)
        self.version, self.failed = "", False
        try:
            ready = self._ask({"model": str(model), "dtype": dtype, "seed": seed, "max_model_len": max_model_len,
                               "speculative_config": speculative_config,
                               "kv_cache_memory_bytes": int(kv_cache_gib * GIB)})
        except BaseException as e:
            self.close(interrupted=isinstance(e, KeyboardInterrupt))
            raise
        self.version, self.load_seconds = ready["vllm"], ready["seconds"]

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone: said below, with its log
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"the vLLM worker exited (code {code}): {last_error(self.log)} (log: {self.log.name})")
        reply = json.loads(line)
        if "error" in reply:
            self.failed = True  # the worker goes on, and exits 0 when closed: its log must stay for the error
            raise RuntimeError(f"vLLM: {reply['error']} (log: {self.log.name})")
        return reply

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, n: int = 1, seed: Optional[int] = None, logprobs: int = 0,
                 stop_token_ids: Sequence[int] = (), one_at_a_time: bool = False) -> Generation:
        """`n` completions of each prompt (token ids, no padding). Temperature 0 is greedy. Prompt i samples with
        seed + i·n (+ j for its j-th completion), so a chunk's samples are reproducible and no two share a seed.
        `one_at_a_time`: one prompt per vLLM call (batch 1, the latency regime), else one batch."""
        reply = self._ask({"prompts": [list(map(int, p)) for p in prompt_ids], "n": n, "temperature": temperature,
                           "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed, "logprobs": logprobs,
                           "stop_token_ids": list(stop_token_ids), "one_at_a_time": one_at_a_time})
        completions = [[Completion(c["token_ids"], c.get("topk_ids", []), c.get("topk_logprobs", [])) for c in row]
                       for row in reply["completions"]]
        return Generation(completions, reply["seconds"], reply["spec_decode"])

    def close(self, interrupted: bool = False) -> None:
        """End the worker: closing its stdin lets it shut vLLM down; a worker that hangs is killed. Interrupted, its
        whole process group is stopped at once (it would finish the request in hand first)."""
        if interrupted:
            stop_group(self.process)
        if self.process.poll() is None:
            assert self.process.stdin is not None
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        forget_child(self.process)
        if self.process.returncode == 0 and not self.failed:
            os.unlink(self.log.name)  # a failed worker's log is kept: errors name it

    def __enter__(self) -> "VllmRunner":
        return self

    def __exit__(self, kind: Optional[type], *exc: Any) -> None:
        self.close(interrupted=kind is not None and issubclass(kind, KeyboardInterrupt))


def verifier_runner(recipe: Any, *, kv_cache_gib: float, seed: int, key: str) -> VllmRunner:
    """The recipe's verifier in a vLLM worker, in the dtype and on the device align would load it with (each rank's
    own GPU under a launcher)."""
    from align.models import resolve_device, resolve_dtype

    device = resolve_device(recipe.verifier.device)
    dtype = resolve_dtype(recipe.verifier.dtype, device, recipe.verifier.path, recipe.verifier.trust_remote_code)
    return VllmRunner(recipe.verifier.path, dtype=vllm_dtype(dtype),
                      kv_cache_gib=kv_cache_gib, seed=seed, cuda_device=device.index if device.type == "cuda" else None,
                      key=key)


def last_error(log: IO[str]) -> str:
    """The line of a worker's log that says what went wrong, as one line. vLLM's engine processes log their
    traceback before the main process's "see root cause above", so the first line naming an exception is the cause;
    pydantic (vLLM's config checks) puts the reason on the indented line after it."""
    log.flush()
    lines = [line.rstrip() for line in Path(log.name).read_text(errors="replace").splitlines() if line.strip()]
    found = next((i for i, line in enumerate(lines) if ("Error:" in line or "Exception:" in line)
                  and " WARNING " not in line), None)  # vLLM logs some harmless exceptions as warnings
    if found is None:
        return lines[-1].strip()[-300:] if lines else "no output"
    cause = lines[found].strip()
    if found + 1 < len(lines) and lines[found + 1].startswith("  ") and not lines[found + 1].lstrip().startswith("File"):
        cause += " " + lines[found + 1].strip()
    return cause[-400:]


@dataclass
class ServeResult:
    """vLLM decoding prompts greedily with `concurrency` requests in flight, as a server answering that many users."""

    #: requests sent together: the prompts go in groups of this many (the last may be smaller); 1: one at a time
    concurrency: int
    outputs: list[list[int]]  # (prompts, generated tokens)
    seconds: float
    tokens_per_second: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    #: accepted drafts at each draft position, summed over drafts (vLLM's num_accepted_tokens_per_pos)
    accepted_per_position: list[int]
    #: tokens per verifier forward: 1 + accepted / drafts (EAGLE's τ, what align's eval reports); 1.0 without drafts
    mean_acceptance_length: float
    vllm_version: str


def serve(model: str, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, dtype: str,
          kv_cache_gib: float, stop_token_ids: Sequence[int] = (), concurrency: Sequence[int] = (1,),
          speculative_config: Optional[dict[str, Any]] = None, key: str = "serve") -> list[ServeResult]:
    """Decode `prompt_ids` greedily with one vLLM engine, with a drafter when `speculative_config` is given
    ({"model": drafter_dir, "num_speculative_tokens": k}), once at each of `concurrency`: c requests in flight at a
    time (groups of c prompts sent together, which vLLM batches as it would c users' requests). A warm-up group at
    each concurrency first, outside the timing (vLLM's CPU kernels are prepared per batch shape)."""
    with VllmRunner(model, dtype=dtype, kv_cache_gib=kv_cache_gib, speculative_config=speculative_config,
                    key=key) as runner:
        results = []
        for c in concurrency:
            runner.generate(prompt_ids[:c], max_new_tokens=min(max_new_tokens, 8), stop_token_ids=stop_token_ids)
            runs = [runner.generate(prompt_ids[i:i + c], max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                    one_at_a_time=c == 1) for i in range(0, len(prompt_ids), c)]
            results.append(served_result(c, runs, runner.version))
    return results


def served_result(concurrency: int, runs: Sequence[Generation], version: str) -> ServeResult:
    """One ServeResult from the generate calls that served the prompts at `concurrency` (counters summed)."""
    seconds = sum(run.seconds for run in runs)
    counters = [run.spec_decode for run in runs]
    drafts, accepted = sum(c["num_drafts"] for c in counters), sum(c["num_accepted_tokens"] for c in counters)
    per_position = [sum(values) for values in itertools.zip_longest(
        *(c["num_accepted_tokens_per_pos"] for c in counters), fillvalue=0)]
    return ServeResult(
        concurrency=concurrency, outputs=[row[0].token_ids for run in runs for row in run.completions],
        seconds=seconds, tokens_per_second=sum(run.num_tokens for run in runs) / seconds if seconds > 0 else 0.0,
        num_drafts=drafts, num_draft_tokens=sum(c["num_draft_tokens"] for c in counters),
        num_accepted_tokens=accepted, accepted_per_position=per_position,
        mean_acceptance_length=1.0 + accepted / drafts if drafts else 1.0, vllm_version=version)


def served_folder_format(folder: Path) -> str:
    """The kind of drafter folder `align serve-check` takes: "speculators" (a DFlash folder vLLM serves) or "align" (an
    align DFlash checkpoint, exported first); anything else is a one-line RecipeError."""
    key = "serve_check.drafter"
    config_path = folder / "config.json"
    if not folder.is_dir() or not config_path.is_file():
        raise RecipeError(f"{key}: {folder} is not a drafter folder (no config.json); export one with "
                          "`align export RECIPE drafter.path=STEP export.format=speculators`")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise RecipeError(f"{key}: {config_path} is not JSON ({e})") from None
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "dflash":
            raise RecipeError(f"{key}: {folder} is a speculators {config['speculators_model_type']!r} drafter; "
                              "align serve-check checks DFlash drafters")
        return "speculators"
    if config.get("model_type") == "align_dflash":
        return "align"
    what = ("a standalone diffusion drafter" if "drafter_spec" in config else
            f"not a drafter (model_type {config.get('model_type')!r})")
    raise RecipeError(f"{key}: {folder} is {what}, which vLLM cannot serve (it serves target-conditioned DFlash "
                      "drafters: train one with recipes/tiny/dflash.yaml)")


def served_drafter_kind(recipe: Any) -> str:
    """`align serve-check`'s input, checked before the stage starts (cli): serve_check.drafter (a folder vLLM can
    serve, or an align DFlash checkpoint), decode.gamma against its block, then vLLM's environment (the inputs first:
    their refusals are the same whichever environments this checkout has). Returns its kind."""
    folder = Path(recipe.serve_check.drafter)
    kind = served_folder_format(folder)
    if kind == "speculators":  # not align's: checked against the format and the verifier as every stage checks it
        from align.drafters.speculators_format import check_dflash_verifier, check_speculators_folder
        from align.preflight import load_model_config

        checked = check_speculators_folder(str(folder), "serve_check.drafter")
        check_dflash_verifier(checked, load_model_config("verifier.path", recipe.verifier), "serve_check.drafter",
                              str(folder))
    config = json.loads((folder / "config.json").read_text())
    block_size = config.get("block_size", 0)
    if recipe.decode.gamma > block_size - 1:
        raise RecipeError(f"decode.gamma: {recipe.decode.gamma} draft tokens, but the drafter's blocks hold "
                          f"{block_size - 1} (block_size {block_size}); set decode.gamma={block_size - 1} or less")
    most, prompts = max(recipe.serve_check.concurrency), recipe.eval.num_prompts
    if prompts is not None and most > prompts:
        raise RecipeError(f"serve_check.concurrency: {most} requests in flight need at least {most} prompts, and "
                          f"eval.num_prompts is {prompts}")
    vllm_python("serve_check")
    return kind
