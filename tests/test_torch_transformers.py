"""pyfa as a transformers attention backend (pyfa.integrations.transformers): tiny GPT-2,
Llama (GQA) and Mistral (GQA, sliding window) models against transformers' SDPA backend
(Gemma 2's softcap and gpt-oss's sinks against its eager one):
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


def sdpa_reference(q, k, v, mask):
    """transformers' SDPA path on the same mask, in float64 (GQA heads expanded)."""
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, 1) for t in (k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask)
    return o.transpose(1, 2)


def test_masks_beyond_spans_run_as_a_bias_and_equal_sdpa():
    pyfa_hf.register()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 6, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, generator=g, requires_grad=True)
    holes = torch.ones(2, 1, 6, 7, dtype=torch.bool).tril(1)
    holes[0, 0, 3, 1] = False  # a key hidden from one row only
    holes[1, 0, :, 2] = False  # a key no row sees, between visible ones
    float_mask = torch.randn(1, 1, 6, 7, generator=g)
    module = torch.nn.Module()
    for mask in (holes, float_mask):
        out, _ = pyfa_hf.attention_forward(module, q, k, v, mask)
        want = sdpa_reference(q, k, v, mask)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want_grads = torch.autograd.grad(want.sum(), (q, k, v))
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5)


def test_what_pyfa_cannot_honour_is_refused():
    pyfa_hf.register()
    q = torch.zeros(1, 2, 4, 8)
    holes = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    holes[0, 0, 3, 1] = False
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="attention_mask: expected a boolean or float mask"):
        pyfa_hf.attention_forward(module, q, q, q, torch.zeros(1, 1, 4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        pyfa_hf.attention_forward(module, q, q, q, holes[:, :, :3])
    with pytest.raises(ValueError, match="position_bias: not supported"):
        pyfa_hf.attention_forward(module, q, q, q, None, position_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="sinks: not supported"):  # not gpt-oss's s_aux: never ignored
        pyfa_hf.attention_forward(module, q, q, q, None, sinks=torch.zeros(1, 1, 1, 1))


def equals_eager(model_class, config, padding):
    """pyfa against transformers' eager attention on the same weights: logits on the valid
    positions and every parameter's gradient; returns (eager, ours, ids, mask)."""
    pyfa_hf.register()
    torch.manual_seed(0)
    eager = model_class(config)
    ours = copy.deepcopy(eager)
    eager.set_attn_implementation("eager")
    ours.set_attn_implementation("pyfa")
    ids, mask = batch(padding)
    (la, a), (lb, b) = (loss_and_logits(m, ids, mask) for m in (eager, ours))
    valid = mask.bool()
    torch.testing.assert_close(b[valid], a[valid], rtol=1e-5, atol=1e-5)
    la.backward()
    lb.backward()
    for (name, pa), (_, pb) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=name)
    return eager, ours, ids, mask


def test_gemma2_logit_softcap_equals_eager():
    # Gemma 2 passes its attention softcap to the attention function; transformers' eager
    # path applies it explicitly (SDPA's cannot), so eager is the reference.
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                       sliding_window=5, attn_logit_softcapping=2.0,
                                       final_logit_softcapping=None)
    equals_eager(transformers.Gemma2ForCausalLM, config, "right")


@pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="this transformers has no gpt-oss")
def test_gpt_oss_attention_sinks_equal_eager():
    # gpt-oss passes its learned sinks as s_aux; transformers runs them eagerly only.
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                                       max_position_embeddings=64)
    eager, ours, ids, mask = equals_eager(transformers.GptOssForCausalLM, config, "left")
    assert ours.model.layers[0].self_attn.sinks.grad.abs().max() > 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.eval().generate(ids, **kw), eager.eval().generate(ids, **kw))


def test_training_dropout_is_pyfas_and_reproducible():
    pyfa_hf.register()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2,
                                     n_head=4, attn_pdrop=0.1, resid_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    model.set_attn_implementation("pyfa")
    ids, mask = batch("none")
    runs = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        model.train()
        loss, logits = loss_and_logits(model, ids, mask)
        grad = torch.autograd.grad(loss, model.transformer.h[0].attn.c_attn.weight)[0]
        runs.append((logits.detach(), grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])
    model.eval()  # transformers passes dropout=0.0 outside training: SDPA's logits
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, sdpa(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_the_mask_reaches_pyfa():
    pyfa_hf.register()
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS["pyfa"] is pyfa_hf.attention_forward
    assert "pyfa" in ALL_MASK_ATTENTION_FUNCTIONS


def test_a_masks_spans_are_found_again_after_it_changes_in_place():
    # The spans of the mask every layer gets are remembered per tensor and its _version.
    keep = torch.ones(2, 1, 4, 6, dtype=torch.bool).tril(2)
    keep[1, :, :, :2] = False  # left padding on batch row 1

    def fresh(m):
        return pyfa_hf._spans(m[:, 0].expand(2, 4, 6))
    first = pyfa_hf._spans_of(keep, 2, 4, 6)
    assert first == fresh(keep) and first[0] != first[1]
    assert pyfa_hf._spans_of(keep, 2, 4, 6) is first
    keep[0, :, :, :1] = False  # in place: a new _version
    again = pyfa_hf._spans_of(keep, 2, 4, 6)
    assert again == fresh(keep) and again != first
    other = keep.clone()
    other[1] = True
    assert pyfa_hf._spans_of(other, 2, 4, 6) == fresh(other) != again
    assert pyfa_hf._spans_of(keep, 2, 4, 6) is again
    with torch.inference_mode():  # no version counter: found afresh each time
        frozen = keep.clone()
    assert pyfa_hf._spans_of(frozen, 2, 4, 6) == again


def test_the_last_few_masks_spans_are_remembered_together():
    # Models with sliding and full layers alternate two masks within one forward.
    masks = [torch.ones(1, 1, 3, 3 + n, dtype=torch.bool) for n in range(4)]
    first = [pyfa_hf._spans_of(m, 1, 3, m.shape[-1]) for m in masks]
    assert all(pyfa_hf._spans_of(m, 1, 3, m.shape[-1]) is f for m, f in zip(masks, first))
