"""Block Attention Residuals: which sources each sublayer mixes (reference §3), and the mix itself."""

import torch

from mopd.model.attnres import BlockResiduals, PseudoQuery, attn_res


def test_sublayers_mix_embedding_completed_blocks_and_partial_sum():
    embedding = torch.zeros(1, 1, 1)
    residuals = BlockResiduals(embedding, block_size=2)
    seen = []

    def record(sources):
        seen.append([float(s) for s in sources])
        return sources[-1]

    outputs = iter(float(2**i) for i in range(8))  # a0, m0, a1, m1, ... as distinct bits
    for layer in range(4):
        residuals.attention_input(layer, record)
        residuals.add_attention(layer, torch.full_like(embedding, next(outputs)))
        residuals.mlp_input(record)
        residuals.add_mlp(torch.full_like(embedding, next(outputs)))
    residuals.output(record)

    block_1 = 1 + 2 + 4 + 8  # layers 0-1: a0 + m0 + a1 + m1
    assert seen == [
        [0.0, 1.0],  # layer 0 mlp (its attention reads the embedding alone: no mix)
        [0.0, 3.0],  # layer 1 attention: embedding + partial a0+m0
        [0.0, 7.0],  # layer 1 mlp
        [0.0, block_1],  # layer 2 opens a block: embedding + completed block 1
        [0.0, block_1, 16.0],  # layer 2 mlp: partial restarts at a2
        [0.0, block_1, 16.0 + 32.0],
        [0.0, block_1, 16.0 + 32.0 + 64.0],
        [0.0, block_1, 16.0 + 32.0 + 64.0 + 128.0],  # final AttnRes before the last norm
    ]


def test_plain_residuals_when_block_size_is_none():
    embedding = torch.randn(2, 3, 4)
    residuals = BlockResiduals(embedding, block_size=None)
    a, m = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    assert torch.equal(residuals.attention_input(0, None), embedding)
    residuals.add_attention(0, a)
    assert torch.equal(residuals.mlp_input(None), embedding + a)
    residuals.add_mlp(m)
    assert torch.equal(residuals.output(None), embedding + a + m)


def test_attn_res_is_a_softmax_over_depth_scored_on_normed_sources():
    torch.manual_seed(0)
    sources = [torch.randn(2, 5, 8) * scale for scale in (1.0, 3.0, 0.5)]
    norm, query = torch.nn.RMSNorm(8, eps=1e-6), PseudoQuery(8)
    torch.nn.init.zeros_(query.weight)
    torch.testing.assert_close(attn_res(sources, norm, query), sum(sources) / 3)  # zero query: uniform mix

    torch.nn.init.normal_(query.weight)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    logits = torch.stack([(norm(s) * query.weight[0]).sum(-1) for s in sources])
    expected = sum(w.unsqueeze(-1) * s for w, s in zip(logits.softmax(0), sources, strict=True))
    torch.testing.assert_close(attn_res(sources, norm, query), expected)
