"""Hugging Face transformers with ``attn_implementation="bob"``: tiny random models built from
configs in the test (no downloads). Logits match the eager implementation, and an exact HVP matches
the HVP of the same model on an exact naive attention."""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashbob  # noqa: E402
from flashbob.dropin import FallbackWarning, naive_attention  # noqa: E402
from flashbob.integrations import huggingface  # noqa: E402
from optim import hvp  # noqa: E402


def _naive_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Exact float64 oracle: materialising attention under the boolean mask transformers built for the
    model (eager Llama softmaxes in float32). The ``naive_test`` mask is never skipped
    (:func:`_materialised_mask`), so what is causal comes from the model's own mask function and
    padding, not from a rule shared with the code under test; ``is_causal`` is not read."""
    assert attention_mask is not None, "the naive_test mask interface always materialises the mask"
    out = naive_attention(query, key, value, attention_mask, dropout, False, scaling,
                          enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _materialised_mask(*args, allow_is_causal_skip=True, **kwargs):
    """transformers' SDPA boolean mask, built even where plain causal attention would let it be skipped."""
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, allow_is_causal_skip=False, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    names = huggingface.register()
    assert huggingface.NAME in names
    AttentionInterface.register("naive_test", _naive_forward)
    AttentionMaskInterface.register("naive_test", _materialised_mask)


def configs():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": ("LlamaForCausalLM", LlamaConfig(**small)),
        "qwen2": ("Qwen2ForCausalLM", Qwen2Config(**small)),
        "gpt2": ("GPT2LMHeadModel", GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                               bos_token_id=0, eos_token_id=0)),
    }


def build(family, implementation, dtype, seed=0):
    class_name, config = configs()[family]
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)._from_config(copy.deepcopy(config), attn_implementation=implementation)
    return model.to(dtype).eval()


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 11), generator=gen)
    padding = torch.ones(2, 11, dtype=torch.long)
    padding[1, :4] = 0  # left padding: rows 0-3 of batch 1 see no key
    return ids, padding


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_logits_match_eager_and_exact(family, padded):
    ids, padding = batch()
    mask = padding if padded else None
    real = padding.bool() if padded else torch.ones_like(padding, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # causal (+ padding) must run on the flashbob backends
        bob32 = build(family, huggingface.NAME, torch.float32)(ids, attention_mask=mask).logits
        bob64 = build(family, huggingface.NAME, torch.float64)(ids, attention_mask=mask).logits
    eager32 = build(family, "eager", torch.float32)(ids, attention_mask=mask).logits
    exact64 = build(family, "naive_test", torch.float64)(ids, attention_mask=mask).logits
    assert (bob32[real] - eager32[real]).abs().max() < 1e-5
    assert (bob64[real] - exact64[real]).abs().max() < 1e-10
    assert torch.isfinite(bob64).all()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_exact_hvp(family):
    ids, padding = batch()

    def product(implementation, mask):
        model = build(family, implementation, torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        logits = model(ids, attention_mask=mask).logits
        weights = torch.ones_like(ids) if mask is None else mask
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1),
                                                 reduction="none")
        loss = (loss * weights[:, 1:].reshape(-1)).sum()
        gen = torch.Generator().manual_seed(2)
        vec = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        return torch.cat([x.reshape(-1) for x in hvp(loss, params, vec)])

    def error(a, b):
        return ((a - b).norm() / b.norm()).item()

    # exact: against naive float64 attention, with left padding (fully masked rows) and without
    for mask in (padding, None):
        assert error(product(huggingface.NAME, mask), product("naive_test", mask)) < 1e-10
    # eager (Llama's eager softmax runs in float32; with padding in float64 it gives NaN): unpadded only
    assert error(product(huggingface.NAME, None), product("eager", None)) < 1e-5


def test_other_masks_fall_back_with_a_warning():
    """A mask that is not causal + key padding (here: a custom 4D mask) takes the exact fallback."""
    model = build("llama", huggingface.NAME, torch.float64)
    ids, _ = batch()
    custom = torch.rand(2, 1, 11, 11, generator=torch.Generator().manual_seed(3)) > 0.3
    custom[..., 0] = True
    flashbob.dropin._warned.clear()
    with pytest.warns(FallbackWarning, match="key-padding"):
        got = model(ids, attention_mask=custom).logits
    want = build("llama", "naive_test", torch.float64)(ids, attention_mask=custom).logits
    assert (got - want).abs().max() < 1e-10


def test_attention_sinks_are_refused_and_missing_weights_are_said():
    """A GPT-OSS model passes attention sinks (s_aux; other models call them sinks), which 'bob' dropped: logits
    0.37 off eager's and no gradient for the sinks, without a word; output_attentions=True got no weights silently
    (transformers' own 'sdpa' at least logs it). Now the first raises and the second warns."""
    q = torch.randn(1, 4, 5, 8, dtype=torch.float64)
    for name in ("s_aux", "sinks"):
        with pytest.raises(ValueError, match=rf"does not support attention sinks \(this model passes {name}, "):
            huggingface.flashbob_attention_forward(torch.nn.Module(), q, q, q, None, **{name: torch.zeros(4)})
    llama = build("llama", huggingface.NAME, torch.float64)
    huggingface._warned_attentions = False
    with pytest.warns(UserWarning, match="output_attentions=True returns None for them; use attn_implementation="):
        llama(batch()[0], output_attentions=True)


def test_packed_sequences_given_as_cu_seq_lens_are_kept_apart():
    """DataCollatorWithFlattening passes packed sequences as position_ids and flash-attention's cu_seq_lens_q/_k.
    With a cache (use_cache defaults to True) transformers builds no mask for them, and 'bob' ignored cu_seq_lens:
    plain causal attention across the packed sequences, silently. Now each sequence sees only itself, as with
    flash-attention: the packed logits equal those of each sequence run alone."""
    ids, _ = batch()
    lengths = [4, 3, 4]
    packed = ids[:1]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 4, 7, 11], dtype=torch.int32)
    model = build("llama", huggingface.NAME, torch.float64)
    got = model(packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                max_length_k=4).logits[0]
    naive = build("llama", "naive_test", torch.float64)
    want = torch.cat([naive(part[None]).logits[0] for part in packed[0].split(lengths)])
    assert (got - want).abs().max() < 1e-10


def test_models_that_compute_attention_themselves_are_refused():
    """transformers accepts any registered name for any model, also for those that never call the attention
    interface (Bloom with ALiBi, XGLM, MegatronBERT, ...), and hands them the mask that 'bob' registered: an SDPA
    mask (None for plain causal, else boolean) that they add to their scores as their own mask. Bloom and XGLM
    attended to the future (logits 5e-3 off eager's), MegatronBERT attended to padding (9e-2 off), without a word.
    Now the mask creation refuses them; models that use the interface keep working (the tests above)."""
    ids, padding = batch()
    tiny = {
        "BloomForCausalLM": transformers.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2),
        "XGLMForCausalLM": transformers.XGLMConfig(vocab_size=64, d_model=16, num_layers=1, attention_heads=2,
                                                   ffn_dim=32, max_position_embeddings=32),
        "MegatronBertModel": transformers.MegatronBertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                             num_attention_heads=2, intermediate_size=32),
    }
    for class_name, config in tiny.items():
        model = getattr(transformers, class_name)._from_config(config, attn_implementation=huggingface.NAME).eval()
        for mask in (None, padding):
            with pytest.raises(ValueError, match="compute attention themselves, not through transformers' attention"):
                model(ids, attention_mask=mask)


def test_sliding_window_models_run_in_the_kernels_and_match_eager():
    """A tiny random Mistral and Qwen2 with a sliding window shorter than the sequence: transformers builds a
    sliding-window mask, which 'bob' reads as window= (no fallback): logits equal eager's (float32) and the
    materialising oracle's (float64), and an exact HVP equals the oracle's."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, sliding_window=4)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(5))
    for model_class, config in ((MistralForCausalLM, MistralConfig(**small)),
                                (Qwen2ForCausalLM, Qwen2Config(**small, use_sliding_window=True,
                                                              max_window_layers=0, layer_types=None))):
        def build_model(implementation, dtype, sliding_window=small["sliding_window"]):
            torch.manual_seed(0)
            model_config = copy.deepcopy(config)
            model_config.sliding_window = sliding_window
            return model_class._from_config(model_config, attn_implementation=implementation).to(dtype).eval()

        with warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)
            bob32 = build_model(huggingface.NAME, torch.float32)(ids).logits
            bob64 = build_model(huggingface.NAME, torch.float64)(ids).logits
        eager32 = build_model("eager", torch.float32)(ids).logits
        exact64 = build_model("naive_test", torch.float64)(ids).logits
        full64 = build_model("naive_test", torch.float64, sliding_window=64)(ids).logits  # wider than the input
        assert (bob32 - eager32).abs().max() < 1e-5
        assert (bob64 - exact64).abs().max() < 1e-10
        assert (bob64 - full64).abs().max() > 1e-3, model_class.__name__  # the window matters here


def test_packed_position_ids_run_as_documents_in_the_kernels():
    """A packed Llama batch (position ids restarting, no cu_seq_lens): transformers builds a block-diagonal causal
    mask, which 'bob' reads as document_ids (no fallback); the logits equal each sequence run alone."""
    ids, _ = batch()
    lengths = [4, 3, 4]
    packed = ids[:1]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    model = build("llama", huggingface.NAME, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        got = model(packed, position_ids=position_ids, use_cache=False).logits[0]
    naive = build("llama", "naive_test", torch.float64)
    want = torch.cat([naive(part[None]).logits[0] for part in packed[0].split(lengths)])
    assert (got - want).abs().max() < 1e-10


def test_masks_read_as_flashbob_masks_are_exactly_the_given_mask():
    """The reading of a mask as flashbob's masks is checked element by element: a sliding-window mask with one
    entry flipped is not read as a window (None: it goes on to flashbob.sdpa)."""
    n = 9
    q = torch.randn(1, 2, n, 4, dtype=torch.float64)
    window = flashbob.masks.dense(n, n, causal=True, window=(2, 0))
    module = torch.nn.Module()
    module.is_causal = True
    assert huggingface._as_flashbob_masks(module, q, q, window, {"sliding_window": 3}) == dict(
        causal=True, window=(2, 0), document_ids=None, key_mask=None)
    flipped = window.clone()
    flipped[0, 0, 7, 1] = True
    assert huggingface._as_flashbob_masks(module, q, q, flipped, {"sliding_window": 3}) is None
