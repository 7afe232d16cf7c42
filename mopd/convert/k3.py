"""`mopd init-student --arch k3 --init convert`: a K3 hybrid made from a pretrained Llama-shaped
transformer (the Mamba-in-the-Llama / LoLCATs / Zebra-Llama route: attention is the only part that
changes; embeddings, norms and MLPs carry most of what the model knows).

Layer i of the student is teacher layer `kept[i]` (all of them, or `--layers N` evenly spaced, as
`--arch same` keeps them). Its mixer is the K3 schedule's: MLA on every 4th layer and the last,
KDA elsewhere. The student's config takes the teacher's widths:

- hidden size, vocabulary, tied embeddings, special token ids, RMSNorm eps: the teacher's;
- MLP: every layer dense (`first_k_dense_replace` = number of layers, so no LatentMoE at all),
  `intermediate_size` and SiLU-GLU (`hidden_act="silu"`) as the teacher's: the MLP is copied and
  computes exactly what it did. The LatentMoE (and K3's SiTU activation) is not used;
- Block AttnRes off (`attn_res_block_size=None`): plain residuals, as the teacher's;
- KDA: the teacher's query heads and head dim (`linear_attn_config` num_heads / head_dim);
- MLA: the teacher's query heads, `qk_nope_head_dim` = head dim, `qk_rope_head_dim` = 0,
  `v_head_dim` = head dim, a full query projection (`q_lora_rank=None`), `kv_lora_rank` =
  the rank of the stacked k/v projections unless given (exact; smaller = a truncated SVD).

Copied as they are: embeddings (and an untied head), final norm, input / post-attention RMSNorms,
gate/up/down MLP projections.

Converted, per layer, from the teacher's q/k/v/o projections (GQA key/value heads repeated to the
query heads; RoPE dropped, see below):

- MLA: q_proj = the teacher's q_proj. The latent is an SVD of the stacked key/value projections
  M = [W_k; W_v] = U S V^T: kv_a_proj = V_r^T, kv_b_proj = U_r S_r arranged per head as
  [k_nope_h ; v_h]. The latent's RMSNorm weight is the latent's mean RMS on calibration text, so
  the normalised latent matches V_r^T x on average (per token it differs by that token's RMS
  ratio: this cannot be carried over exactly). Output gate g_proj = 0 (sigmoid 0.5) and o_proj =
  2 * the teacher's o_proj: the gated output equals the ungated one. With rank = rank(M), an
  MLA layer computes the teacher's attention without RoPE.
- KDA ("softmax-free attention of the same projections"): q/k/v_proj from the teacher's. The
  short convolutions pass the current token only (last tap; the others 0) with a small per-head
  gain, so SiLU(conv) is close to linear: for q and k (L2-normalised afterwards, which removes
  the gain) pre-activations have RMS 0.1; for v RMS 0.5 (its scale is removed by the output
  RMSNorm, but too small a scale would drown in that norm's eps). The delta rule's write
  strength beta = sigmoid(0) = 0.5 (b_proj = 0). Decay: f_b_proj = 0 (f_a_proj keeps its random
  init so both get gradients) and A_log / dt_bias set so each key channel forgets with a fixed
  time constant, log-spaced across a head's channels from 16 to 4096 tokens (multi-scale memory:
  near no forgetting in the slow channels, a recency bias in the fast ones). Output gate g_proj = 0
  and the output RMSNorm weight 1; o_proj = the teacher's, each head's columns times 2 (the gate)
  and times that head's output RMS in the teacher on calibration text (KDA normalises each
  head's output to RMS 1; softmax attention does not).

What cannot be carried over:

- RoPE: K3's MLA is NoPE (its "rope" slice is never rotated) and KDA has no positional encoding
  (position comes from its decay and short convolution). The teacher's q/k are used without
  rotation, i.e. every head scores as if at relative distance 0; position-dependent heads
  (previous-token, local) are lost in MLA layers and only approximated by the KDA decays.
- softmax: KDA is linear attention with cosine-similarity scores (L2-normalised q, k, scaled by
  1/sqrt(d)) and a delta-rule state, so no initialisation makes it equal to softmax attention.
- GQA: both mixers have one key/value head per query head; the teacher's shared key/value heads
  are repeated (exact).
- per-token scales: MLA's latent RMSNorm and KDA's output RMSNorm rescale each token; their
  weights are set from calibration averages.
- biases: K3 has no attention or MLP biases; a teacher with them is refused.

Calibration: a fixed English text (built in, no data set), tokenized by the teacher's tokenizer, run
through the teacher once to measure the RMS statistics above.

Optionally (`--transfer-steps N`) the mixers are then trained to match the teacher's per-layer
attention outputs: `mopd.convert.attention_transfer` (LoLCATs' first stage).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from mopd.model.config import preset_config

MLA_PERIOD = 4
Q_K_PREACTIVATION_RMS = 0.1
V_PREACTIVATION_RMS = 0.5
DECAY_TIME_CONSTANTS = (16.0, 4096.0)  # tokens, log-spaced over a KDA head's key channels
CALIBRATION_TEXT = (
    "The history of science is the study of the development of science and scientific knowledge. "
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    "Question: What is 17 plus 25? Answer: 17 plus 25 is 42. "
    "Once upon a time, a small fox lived at the edge of a quiet forest. Every morning she walked "
    "to the river to drink, and every evening she told her children stories about the stars. "
    "The committee will meet on Tuesday to discuss the budget for the next fiscal year, including "
    "proposals for new research equipment and staff training. "
    "User: Can you recommend a good book about the ocean?\nAssistant: Sure! Try \"The Sea Around "
    "Us\" by Rachel Carson, a classic about the science and beauty of the sea."
)


class ConversionError(ValueError):
    """A teacher this conversion cannot carry over (not Llama-shaped)."""


def convert_llama_to_k3(
    source, kept: list[int], preset: str = "small", tokenizer=None, kv_lora_rank: int | None = None,
):  # fmt: skip
    """A `K3HybridForCausalLM` made from `source` (a loaded Llama-shaped `*ForCausalLM`, fp32) and a
    dict saying what was copied and converted. `kept`: the teacher layers, one per student layer."""
    from mopd.model import K3HybridForCausalLM

    config = source.config
    heads, kv_heads, head_dim = attention_shape(config)
    check_llama_shaped(source, config)
    rank_bound = min(2 * kv_heads * head_dim, config.hidden_size)
    rank = rank_bound if kv_lora_rank is None else kv_lora_rank
    if not 1 <= rank <= rank_bound:
        raise ConversionError(f"kv_lora_rank {rank}: choose between 1 and {rank_bound} (the stacked k/v projections' rank bound)")
    layers = len(kept)
    student_config = preset_config(
        preset,
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=layers,
        tie_word_embeddings=bool(config.tie_word_embeddings), pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        num_attention_heads=heads, q_lora_rank=None, kv_lora_rank=rank,
        qk_nope_head_dim=head_dim, qk_rope_head_dim=0, v_head_dim=head_dim,
        mla_use_nope=True, mla_use_output_gate=True, full_attn_period=MLA_PERIOD,
        linear_attn_config={"num_heads": heads, "head_dim": head_dim},
        intermediate_size=config.intermediate_size, first_k_dense_replace=layers,
        hidden_act="silu", attn_res_block_size=None,
    )  # fmt: skip
    student = K3HybridForCausalLM(student_config)
    stats = calibration_stats(source, kept, tokenizer)
    teacher_layers = source.model.layers
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(source.get_input_embeddings().weight)
        if not student_config.tie_word_embeddings:
            student.get_output_embeddings().weight.copy_(source.get_output_embeddings().weight)
        student.model.norm.weight.copy_(source.model.norm.weight)
        for i, j in enumerate(kept):
            ours, theirs = student.model.layers[i], teacher_layers[j]
            ours.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            ours.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(ours.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)
            q, k, v, o = (getattr(theirs.self_attn, f"{p}_proj").weight.float() for p in "qkvo")
            if ours.is_kda:
                kda_from_attention(ours.self_attn, q, k, v, o, heads, kv_heads, stats[j])
            else:
                mla_from_attention(ours.self_attn, q, k, v, o, heads, kv_heads, stats[j])
    student.generation_config = source.generation_config
    made = {
        "preset": preset, "init": "convert", "layers": layers,
        "teacher_layers": config.num_hidden_layers, "kept_layers": kept,
        "kda_layers": [i for i in range(layers) if student_config.is_kda_layer(i)],
        "mla_layers": [i for i in range(layers) if not student_config.is_kda_layer(i)],
        "kv_lora_rank": rank, "calibration_tokens": stats["tokens"],
        "copied": ["embeddings", *([] if student_config.tie_word_embeddings else ["lm_head"]), "final norm",
                   "input_layernorm", "post_attention_layernorm", "mlp (dense, silu)"],
        "converted": {
            "mla": "q_proj copied; kv_a/kv_b from an SVD of stacked k/v (GQA repeated); gate 0, o_proj x2",
            "kda": "q/k/v/o_proj from the teacher's (GQA repeated); conv passes the current token; "
                   f"beta 0.5; decay time constants {DECAY_TIME_CONSTANTS[0]:g}-{DECAY_TIME_CONSTANTS[1]:g} tokens; "
                   "o_proj scaled by the teacher's per-head output RMS",
        },
        "not_carried": ["RoPE (NoPE mixers)", "softmax (KDA is linear attention)", "LatentMoE (all layers dense)",
                        "Block AttnRes (plain residuals)"],
    }  # fmt: skip
    return student, made


def attention_shape(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ConversionError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    return heads, kv_heads, head_dim


def check_llama_shaped(source, config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"the teacher's MLP uses {config.hidden_act!r}; K3's dense MLP can copy SiLU-GLU only")
    layer = source.model.layers[0]
    for module, names in ((layer.self_attn, "qkvo"), (layer.mlp, ("gate", "up", "down"))):
        for name in names:
            proj = getattr(module, f"{name}_proj", None)
            if proj is None:
                raise ConversionError(f"the teacher's layers have no {name}_proj: not Llama-shaped")
            if getattr(proj, "bias", None) is not None:
                raise ConversionError(f"the teacher's {name}_proj has a bias, which K3 cannot hold")


# ----------------------------------------------------------------------------- calibration
@torch.no_grad()
def calibration_stats(source, kept: list[int], tokenizer) -> dict:
    """Per teacher layer j: the attention input x [T, D] (after input_layernorm) and each head's
    output RMS before o_proj [H]. One forward over the built-in text."""
    ids = calibration_ids(tokenizer, source.config.vocab_size)
    captured: dict[int, dict[str, Tensor]] = {j: {} for j in kept}
    hooks = []
    for j in kept:
        attention = source.model.layers[j].self_attn

        def take_input(_module, args, kwargs, j=j):
            captured[j]["x"] = (args[0] if args else kwargs["hidden_states"])[0].float()

        def take_output(_module, args, j=j):
            captured[j]["o"] = args[0][0].float()

        hooks.append(attention.register_forward_pre_hook(take_input, with_kwargs=True))
        hooks.append(attention.o_proj.register_forward_pre_hook(take_output))
    try:
        source(input_ids=torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    heads, _, head_dim = attention_shape(source.config)
    out: dict = {"tokens": len(ids)}
    for j, got in captured.items():
        head_rms = got["o"].view(-1, heads, head_dim).square().mean(dim=(0, 2)).sqrt()
        out[j] = {"x": got["x"], "head_rms": head_rms}
    return out


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    ids = []
    if tokenizer is not None:
        ids = [i for i in tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"] if 0 <= i < vocab_size]
    if len(ids) < 64:  # no usable tokenizer: fixed pseudo-random tokens instead
        ids = torch.randint(0, vocab_size, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    return ids[:512]


# ----------------------------------------------------------------------------- mixers
def repeat_kv(weight: Tensor, heads: int, kv_heads: int) -> Tensor:
    """[kv_heads*d, D] -> [heads*d, D]: each key/value head repeated for the query heads sharing it."""
    per_head = weight.view(kv_heads, -1, weight.shape[-1])
    return per_head.repeat_interleave(heads // kv_heads, dim=0).flatten(0, 1)


def per_head_rms(weight: Tensor, x: Tensor, heads: int) -> Tensor:
    """RMS of (weight @ x) per head over calibration tokens x [T, D]: [heads]."""
    y = (x @ weight.T).view(x.shape[0], heads, -1)
    return y.square().mean(dim=(0, 2)).sqrt().clamp_min(1e-6)


def kda_from_attention(kda, q, k, v, o, heads: int, kv_heads: int, stats: dict) -> None:
    k, v = repeat_kv(k, heads, kv_heads), repeat_kv(v, heads, kv_heads)
    x, head_dim = stats["x"], kda.head_dim
    for proj, conv, weight, target in (
        (kda.q_proj, kda.q_conv1d, q, Q_K_PREACTIVATION_RMS),
        (kda.k_proj, kda.k_conv1d, k, Q_K_PREACTIVATION_RMS),
        (kda.v_proj, kda.v_conv1d, v, V_PREACTIVATION_RMS),
    ):
        proj.weight.copy_(weight)
        gain = target / per_head_rms(weight, x, heads)  # [H]
        conv.weight.zero_()
        conv.weight[:, 0, -1] = gain.repeat_interleave(head_dim)  # the last tap is the current token
    kda.b_proj.weight.zero_()
    kda.f_b_proj.weight.zero_()
    tau = torch.logspace(math.log10(DECAY_TIME_CONSTANTS[0]), math.log10(DECAY_TIME_CONSTANTS[1]), head_dim)
    decay = (1.0 / tau).repeat(heads)  # -g per channel: exp(g) = exp(-1/tau)
    kda.A_log.zero_()  # rate exp(A_log) = 1
    if kda.lower_bound is None:  # g = -softplus(dt_bias): softplus^-1(1/tau)
        kda.dt_bias.copy_(decay + torch.log(-torch.expm1(-decay)))
    else:  # g = lb * sigmoid(dt_bias): logit(-g / -lb)
        p = decay / -kda.lower_bound
        kda.dt_bias.copy_(torch.log(p) - torch.log1p(-p))
    gate = kda.g_proj if kda.use_full_rank_gate else kda.g_b_proj
    gate.weight.zero_()
    kda.o_norm.weight.fill_(1.0)
    scale = 2.0 * stats["head_rms"].repeat_interleave(head_dim)  # sigmoid(0) = 0.5; KDA heads leave at RMS 1
    kda.o_proj.weight.copy_(o * scale)


def mla_from_attention(mla, q, k, v, o, heads: int, kv_heads: int, stats: dict) -> None:
    rank, head_dim = mla.kv_lora_rank, mla.v_head_dim
    stacked = torch.cat([k, v])  # [2*kv_heads*d, D]
    U, S, Vh = torch.linalg.svd(stacked.double(), full_matrices=False)
    down = Vh[:rank].float()  # [r, D]
    up = (U[:, :rank] * S[:rank]).float()  # [2*kv_heads*d, r]
    k_up = repeat_kv(up[: kv_heads * head_dim], heads, kv_heads).view(heads, head_dim, rank)
    v_up = repeat_kv(up[kv_heads * head_dim :], heads, kv_heads).view(heads, head_dim, rank)
    mla.q_proj.weight.copy_(q)
    mla.kv_a_proj_with_mqa.weight.copy_(down)
    mla.kv_b_proj.weight.copy_(torch.cat([k_up, v_up], dim=1).flatten(0, 1))
    latent_rms = (stats["x"] @ down.T).square().mean(dim=-1).sqrt()
    mla.kv_a_layernorm.weight.fill_(float(latent_rms.mean()))
    mla.g_proj.weight.zero_()
    mla.o_proj.weight.copy_(2.0 * o)


def load_teacher(teacher: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32)
    try:
        tokenizer = AutoTokenizer.from_pretrained(teacher)
    except (OSError, ValueError):
        tokenizer = None
    return source, tokenizer
