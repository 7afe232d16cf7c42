"""Teacher scorers: each teacher's model scoring the student's exact token ids.

`score` is one prefill over prompt + completion (no generation, no re-tokenisation) at
temperature 1, returning per completion token the log-prob of the token the student sampled,
and optionally the teacher's top-k or full next-token distribution. A teacher may be any HF
causal LM that shares the student's tokenizer (the route table checks that before any work)
and whose logits are its output embeddings applied to its decoder's hidden states (checked at load).

Memory is linear in tokens: the LM head runs only at completion positions, a bounded chunk of
positions at a time, so no [B, T, V] tensor exists. Only `full` keeps [T, V] per sequence, and it
warns when that exceeds 1 GiB in a call.

With `packing` (`distill.packing`) short sequences share rows as wide as a batch's longest, back to back
with position ids restarting at each (`mopd.distill.packing`), instead of padding; a teacher that cannot
keep packed sequences apart (the K3 hybrid) is refused at load.

`VllmTeacherScorer` (`distill.scoring: vllm`) scores by a prefill in a vLLM engine instead
(`prompt_logprobs`, the engine's own batching): the sampled token's log-prob and optionally a top-k,
never the full distribution, so the exact full-vocabulary KL keeps the HF scorer.

`TeacherPool` runs one scorer per distinct teacher checkpoint, as Ray actors by default (teachers
score in parallel, each in its own process) or in-process for small local runs. With
`max_resident` it keeps at most that many teachers' weights loaded at once, an LRU: a step's
requests are grouped by teacher, the resident teachers score first, and each other teacher is
loaded (evicting the least recently used) once for its whole group, so a step loads a teacher at
most once. With a cap, the teachers past the first `max_resident` are first loaded (and their
logits checked) when a step first needs them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mopd.distill.packing import check_packing, packed_rows
from mopd.distill.routing import RouteTable
from mopd.precision import autocast


@dataclass
class TeacherScores:
    logprobs: torch.Tensor  # [T] log πT of the sampled completion tokens
    topk_ids: torch.Tensor | None = None  # [T, k]
    topk_logprobs: torch.Tensor | None = None  # [T, k]
    full_logprobs: torch.Tensor | None = None  # [T, V]


class TeacherScorer:
    """Scores in memory linear in tokens: the model body runs once over each padded batch, the LM head
    only over completion positions, `logits_chunk_bytes` of fp32 logits at a time (never [B, T, V]).
    `precision` bf16: body and head under bf16 autocast (the weights stay `dtype`), the logits cast to fp32
    before the log-softmax."""

    def __init__(
        self, checkpoint: str | Path, dtype: str = "float32", max_batch_tokens: int = 16384, threads: int = 0,
        device: str = "cpu", logits_chunk_bytes: int = 256 * 2**20, load: bool = True, precision: str | None = None,
        packing: bool = False,
    ):  # fmt: skip
        if threads:
            torch.set_num_threads(threads)
        self.checkpoint = str(checkpoint)
        self.dtype = getattr(torch, dtype)
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.logits_chunk_bytes = logits_chunk_bytes
        self.precision = precision  # bf16: the body and head run under autocast; the log-softmax is fp32
        self.packing = packing  # batches of packed rows (`mopd.distill.packing`), `max_batch_tokens` real tokens each
        self.model = None
        self.resident = False
        self.tokens_scored = 0
        if load:
            self.load()

    def load(self) -> None:
        """Puts the weights on the device: read from the checkpoint, or moved back from CPU memory after `offload`."""
        if self.model is None:
            self.read_checkpoint()
        self.model.to(self.device)
        self.resident = True

    def offload(self) -> None:
        # On a GPU the weights wait in CPU memory (a host-to-device copy brings them back); on CPU that
        # would free nothing, so the module is dropped and `load` re-reads the checkpoint, already on disk.
        if self.device.type == "cpu":
            self.model = self.body = self.head = None
        else:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.resident = False

    def read_checkpoint(self) -> None:
        from transformers import AutoModelForCausalLM

        import mopd.model  # noqa: F401  (registers the K3 hybrid with the Auto classes)

        self.model = AutoModelForCausalLM.from_pretrained(self.checkpoint, dtype=self.dtype).eval().to(self.device)
        self.body, self.head = self.model.get_decoder(), self.model.get_output_embeddings()
        self.vocab_size = self.head.weight.shape[0]
        self.check_logits_are_head_of_body()
        if self.packing:
            check_packing(self.model, f"teacher {self.checkpoint}")
        self.pad_id = self.model.config.pad_token_id or 0
        self.chunk_tokens = max(1, self.logits_chunk_bytes // (4 * self.vocab_size))

    @torch.inference_mode()
    def check_logits_are_head_of_body(self) -> None:
        # Chunked scoring assumes logits = head(body(x)); a model that caps or scales its logits does not.
        probe = torch.arange(1, 5, device=self.device)[None] % self.vocab_size
        expected = self.model(input_ids=probe, use_cache=False).logits.float()
        composed = self.head(self.body(input_ids=probe, use_cache=False).last_hidden_state).float()
        if not torch.allclose(composed, expected, rtol=1e-4, atol=1e-5):
            raise ValueError(
                f"teacher {self.checkpoint}: {type(self.model).__name__} logits are not its output embeddings "
                "applied to its decoder's hidden states (logit capping or scaling?); the scorer cannot chunk them"
            )

    @torch.inference_mode()
    def score(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int = 0, full: bool = False
    ) -> list[TeacherScores]:
        check_requests(prompt_ids, completion_ids)
        if not self.resident:
            raise RuntimeError(f"teacher {self.checkpoint} is offloaded: load() it before scoring")
        if full:
            warn_if_full_is_large(sum(len(c) for c in completion_ids), self.vocab_size)
        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        out: list[TeacherScores | None] = [None] * len(sequences)
        batches = packed_batches if self.packing else token_budget_batches
        for batch in batches(sequences, self.max_batch_tokens):
            with autocast(self.device, self.precision):
                hidden, starts = self.hidden_states([sequences[i] for i in batch])
            for row, i in enumerate(batch):
                start, n = starts[row] + len(prompt_ids[i]) - 1, len(completion_ids[i])
                tokens = torch.tensor(completion_ids[i], device=self.device)
                out[i] = self.completion_scores(hidden[start : start + n], tokens, top_k, full)
        self.tokens_scored += sum(len(c) for c in completion_ids)
        return out  # type: ignore[return-value]

    def hidden_states(self, sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """([positions, hidden] of the batch's rows one after the other, the position each sequence starts at).
        Padded rows: right padding is invisible to a causal model. Packed: the position ids separate the sequences."""
        if self.packing:
            input_ids, position_ids, starts = packed_rows(sequences, self.pad_id, device=self.device)
            hidden = self.body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            return hidden.flatten(0, 1), starts
        width = max(len(s) for s in sequences)
        batch = torch.tensor([s + [self.pad_id] * (width - len(s)) for s in sequences], device=self.device)
        hidden = self.body(input_ids=batch, use_cache=False).last_hidden_state
        return hidden.flatten(0, 1), [row * width for row in range(len(sequences))]

    def completion_scores(self, hidden: torch.Tensor, tokens: torch.Tensor, top_k: int, full: bool) -> TeacherScores:
        """Log-softmax in fp32 of head(hidden), `chunk_tokens` positions at a time, written into [T]-sized outputs."""
        n = len(tokens)
        scores = TeacherScores(logprobs=torch.empty(n))
        if top_k:
            scores.topk_logprobs, scores.topk_ids = torch.empty(n, top_k), torch.empty(n, top_k, dtype=torch.long)
        if full:
            scores.full_logprobs = torch.empty(n, self.vocab_size)
        for start in range(0, n, self.chunk_tokens):
            rows = slice(start, start + self.chunk_tokens)
            with autocast(self.device, self.precision):
                logits = self.head(hidden[rows]).float()
            normaliser = logits.logsumexp(-1, keepdim=True)
            scores.logprobs[rows] = (logits.gather(-1, tokens[rows, None]) - normaliser).squeeze(-1)
            if top_k:
                values, ids = logits.topk(top_k, dim=-1)
                scores.topk_logprobs[rows], scores.topk_ids[rows] = values - normaliser, ids
            if full:
                scores.full_logprobs[rows] = logits.sub_(normaliser)
        return scores


def check_requests(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"score: {len(prompt_ids)} prompts but {len(completion_ids)} completions")
    empty = [i for i, prompt in enumerate(prompt_ids) if not prompt]
    if empty:
        raise ValueError(f"score: requests {empty} have an empty prompt (the first completion token needs a context)")


FULL_VOCAB_WARN_BYTES = 2**30


def warn_if_full_is_large(tokens: int, vocab_size: int) -> None:
    size = 4 * tokens * vocab_size
    if size > FULL_VOCAB_WARN_BYTES:
        warnings.warn(
            f"full-vocabulary teacher scores keep [T, V] per sequence: {tokens} tokens x {vocab_size} fp32 = {size:,} bytes",
            stacklevel=3,
        )


def token_budget_batches(sequences: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length so that each padded batch holds at most max_tokens (a longer
    sequence is a batch of its own)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(sequences[i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class VllmTeacherScorer:
    """A teacher scoring in a vLLM engine: one prefill per sequence under the engine's own batching
    (`prompt_logprobs`), giving the sampled token's log-prob and, with `top_k`, the teacher's k most likely
    tokens (at most vLLM's `max_logprobs`, 20). No full distribution: the exact KL needs `TeacherScorer`.
    `precision` bf16: the engine computes in bf16; otherwise fp32. `offload` shuts the engine down, `load`
    starts it again (an engine start costs tens of seconds on CPU)."""

    def __init__(
        self, checkpoint: str | Path, threads: int = 0, load: bool = True, precision: str | None = None, max_model_len: int = 2048
    ):  # fmt: skip
        if threads:
            torch.set_num_threads(threads)
        self.checkpoint = str(checkpoint)
        self.dtype = "bfloat16" if precision == "bf16" else "float32"
        self.max_model_len = max_model_len
        self.engine = None
        self.tokens_scored = 0
        if load:
            self.load()

    @property
    def resident(self) -> bool:
        return self.engine is not None

    def load(self) -> None:
        from mopd.rollout.vllm_backend import VllmEngine

        if self.engine is None:
            self.engine = VllmEngine(self.checkpoint, max_model_len=self.max_model_len, dtype=self.dtype)

    def offload(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def score(
        self, prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int = 0, full: bool = False
    ) -> list[TeacherScores]:
        check_requests(prompt_ids, completion_ids)
        if full:
            raise ValueError(f"teacher {self.checkpoint}: vLLM scores no full-vocabulary distribution (distill.scoring: hf does)")
        if not self.resident:
            raise RuntimeError(f"teacher {self.checkpoint} is offloaded: load() it before scoring")
        if top_k:
            out = self.top_k_scores(prompt_ids, completion_ids, top_k)
        else:
            out = [TeacherScores(logprobs=torch.tensor(lp)) for lp in self.engine.score(prompt_ids, completion_ids)]
        self.tokens_scored += sum(len(c) for c in completion_ids)
        return out

    def top_k_scores(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int) -> list[TeacherScores]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False)
        outputs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [
            top_k_of(out.prompt_logprobs[len(prompt) :], completion, top_k)
            for out, prompt, completion in zip(outputs, prompt_ids, completion_ids, strict=True)
        ]


def top_k_of(steps: list[dict], tokens: list[int], top_k: int) -> TeacherScores:
    """TeacherScores from vLLM's per-position {token: Logprob} (the k most likely, and the sampled token)."""
    best = [sorted(step.items(), key=lambda item: -item[1].logprob)[:top_k] for step in steps]
    return TeacherScores(
        logprobs=torch.tensor([step[token].logprob for step, token in zip(steps, tokens, strict=True)]),
        topk_ids=torch.tensor([[token for token, _ in row] for row in best]),
        topk_logprobs=torch.tensor([[logprob.logprob for _, logprob in row] for row in best]),
    )


def packed_batches(sequences: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices in order, cut into runs of at most max_tokens real tokens (a longer sequence is a run of its own)."""
    batches: list[list[int]] = []
    tokens = 0
    for i, sequence in enumerate(sequences):
        if not batches or tokens + len(sequence) > max_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(i)
        tokens += len(sequence)
    return batches


class TeacherPool:
    """One scorer per distinct teacher checkpoint; `score` sends each sample to its cell's teacher.
    At most `max_resident` teachers hold their weights at once (null: all of them)."""

    def __init__(
        self, table: RouteTable, use_ray: bool = True, num_cpus: float = 0.1, num_gpus: float = 0.0, threads: int = 1,
        ray_address: str | None = None, max_resident: int | None = None, precision: str | None = None,
        scoring: str = "hf", packing: bool = False, max_model_len: int = 2048,
    ):  # fmt: skip
        if max_resident is not None and max_resident < 1:
            raise ValueError(f"max_resident teachers must be at least 1, got {max_resident}")
        self.table = table
        self.use_ray = use_ray
        paths = list(table.teachers)
        self.max_resident = min(max_resident or len(paths), len(paths))
        self.resident = paths[: self.max_resident]  # least recently used first
        self.loads = 0
        if use_ray:
            import ray

            from mopd.cluster import connect_ray

            connect_ray(ray_address)
            device = "cuda" if num_gpus > 0 else "cpu"
            scorer, options = scorer_kind(scoring, device, packing, max_model_len)
            actor = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)(scorer)
            self.scorers = {
                path: actor.remote(path, threads=threads, load=path in self.resident, precision=precision, **options)
                for path in paths
            }
        else:
            device = "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"
            scorer, options = scorer_kind(scoring, device, packing, max_model_len)
            self.scorers = {path: scorer(path, load=path in self.resident, precision=precision, **options) for path in paths}

    def score(
        self, cells: list[str], prompt_ids: list[list[int]], completion_ids: list[list[int]], top_k: int = 0, full: bool = False
    ) -> list[TeacherScores]:
        """Scores in the order of the samples; all resident teachers work at once when they are actors."""
        by_teacher: dict[Path, list[int]] = {}
        for i, cell in enumerate(cells):
            by_teacher.setdefault(self.table.teacher_for(cell), []).append(i)
        pending = {}
        for path in sorted(by_teacher, key=lambda path: path not in self.resident):
            self.make_resident(path)
            rows = by_teacher[path]
            pending[path] = self._call(path, "score", [prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], top_k, full)
        results: list[TeacherScores | None] = [None] * len(cells)
        for path, rows in by_teacher.items():
            for i, scores in zip(rows, self._result(pending[path]), strict=True):
                results[i] = scores
        return results  # type: ignore[return-value]

    def make_resident(self, path: Path) -> None:
        """Marks `path` most recently used, loading it after evicting the least recently used if the pool is full."""
        if path in self.resident:
            self.resident.remove(path)
        else:
            while len(self.resident) >= self.max_resident:
                self._result(self._call(self.resident.pop(0), "offload"))  # waits for its scoring to finish
            self._result(self._call(path, "load"))  # an actor's failed load raises here, not as "offloaded" later
            self.loads += 1
        self.resident.append(path)

    def _call(self, path, method, *args):
        scorer = self.scorers[path]
        if self.use_ray:
            return getattr(scorer, method).remote(*args)
        return getattr(scorer, method)(*args)

    def _result(self, pending):
        if self.use_ray:
            import ray

            return ray.get(pending)
        return pending

    def close(self) -> None:
        if self.use_ray:
            import ray

            for actor in self.scorers.values():
                ray.kill(actor)
        else:
            for scorer in self.scorers.values():
                scorer.offload()  # a vLLM teacher's engine now, not under the next engine of this process
        self.scorers = {}


def scorer_kind(scoring: str, device: str, packing: bool, max_model_len: int) -> tuple[type, dict]:
    """The scorer class of `distill.scoring` and its own options."""
    if scoring == "vllm":
        return VllmTeacherScorer, {"max_model_len": max_model_len}
    return TeacherScorer, {"device": device, "packing": packing}
