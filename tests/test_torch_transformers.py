"""pyfa as a transformers attention backend (pyfa.integrations.transformers): tiny GPT-2,
Llama (GQA) and Mistral (GQA, sliding window) models against transformers' SDPA backend:
logits and every parameter's gradient, unpadded, right- and left-padded; greedy
generation; a short AdamW run; and the masks and arguments it refuses. Runs when torch and transformers import."""

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import pyfa.integrations.transformers as pyfa_hf  # noqa: E402  (needs torch and transformers)

VOCAB, N = 48, 12


def gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def mistral():
    # A sliding window shorter than the batch: the mask is a band, not just causal.
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=5)
    return transformers.MistralForCausalLM(config)


MODELS = {"gpt2": gpt2, "llama": llama, "mistral": mistral}


def pair(name, seed=0):
    """The same weights twice: one on transformers' SDPA, one on pyfa."""
    pyfa_hf.register()
    torch.manual_seed(seed)
    sdpa = MODELS[name]()
    ours = copy.deepcopy(sdpa)
    sdpa.set_attn_implementation("sdpa")
    ours.set_attn_implementation("pyfa")
    assert ours.config._attn_implementation == "pyfa"
    return sdpa, ours


def batch(padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, N), generator=g)
    mask = torch.ones(3, N, dtype=torch.long)
    if padding == "right":
        mask[1, 9:] = 0
        mask[2, 4:] = 0
    elif padding == "left":
        mask[1, :3] = 0
        mask[2, :7] = 0
    return ids, mask


def loss_and_logits(model, ids, mask):
    labels = ids.masked_fill(mask == 0, -100)  # padded positions carry no loss
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    return out.loss, out.logits


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_logits_and_every_gradient_equal_sdpa(name, padding):
    sdpa, ours = pair(name)
    ids, mask = batch(padding)
    valid = mask.bool()
    results = []
    for model in (sdpa, ours):
        loss, logits = loss_and_logits(model, ids, mask)
        loss.backward()
        results.append((loss, logits))
    (loss_s, logits_s), (loss_p, logits_p) = results
    torch.testing.assert_close(logits_p[valid], logits_s[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-6, atol=1e-6)
    named = dict(sdpa.named_parameters())
    for pname, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        torch.testing.assert_close(p.grad, named[pname].grad, rtol=1e-4, atol=1e-6, msg=pname)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("padding", ["none", "left"])
def test_greedy_generate_gives_sdpa_tokens(name, padding):
    sdpa, ours = pair(name, seed=1)
    ids, mask = batch(padding, seed=1)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = sdpa.eval().generate(ids, **kw)
        got = ours.eval().generate(ids, **kw)
    assert got.shape == (3, N + 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_adamw_training_follows_sdpa_loss_curve(name):
    sdpa, ours = pair(name, seed=2)
    ids, mask = batch("left", seed=2)
    curves = []
    for model in (sdpa, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(15):
            opt.zero_grad()
            loss, _ = loss_and_logits(model, ids, mask)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[1][-1] < curves[1][0]
    for a, b in zip(*curves):
        assert abs(a - b) <= 1e-5, curves


def test_masks_pyfa_cannot_honour_are_refused():
    pyfa_hf.register()
    q = torch.zeros(1, 2, 4, 8)
    holes = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    holes[0, 0, 3, 1] = False  # a key hidden from one row only: needs a bias
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="attention_mask: this mask is not a contiguous span"):
        pyfa_hf.attention_forward(module, q, q, q, holes)
    stripes = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    stripes[..., 1] = False  # a key no row sees, between visible ones
    with pytest.raises(ValueError, match="attention_mask: this mask is not a contiguous span"):
        pyfa_hf.attention_forward(module, q, q, q, stripes)
    with pytest.raises(ValueError, match="attention_mask: expected the boolean mask"):
        pyfa_hf.attention_forward(module, q, q, q, torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="dropout: pyfa has no dropout"):
        pyfa_hf.attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="softcap: not supported"):
        pyfa_hf.attention_forward(module, q, q, q, None, softcap=50.0)


def test_the_mask_reaches_pyfa():
    pyfa_hf.register()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS["pyfa"] is pyfa_hf.attention_forward
    assert "pyfa" in ALL_MASK_ATTENTION_FUNCTIONS
