"""GradientScaler inside the frameworks users train with: PyTorch
Lightning 2.6, Hugging Face Accelerate and Hugging Face ``transformers``
models (installed by ``make test`` as an optional stage; each part is
skipped, saying why, where its framework does not import).

Each test runs with the kinds of dropin_scalers where it means something
for them: ``torch.amp.GradScaler`` (the reference, which proves the
test), ``GradientScaler(mode='dynamic-gradscaler')`` and ``mode='gs'``, built with
the model and without GradScaler's settings in mode 'gs' (which takes
them and has no use for them; test_gradscaler_dropin.py passes them).
Every kind must pass every test (issue 34): none is marked, and a test is
skipped only where its framework does not import.
"""

import functools
import importlib
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip('torch')

from dropin_scalers import (GRADSCALER, GS, cases,  # NOQA
                            loss_scale_settings, make)


def framework(name):
    """The module, or a skip that says what is missing and how to get
    it (``make test`` installs it on Python 3.11)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        pytest.skip('{} is not importable ({}): make setup-test installs it '
                    '(the Makefile\'s TORCH_FRAMEWORKS)'.format(name, e))


# -- PyTorch Lightning ------------------------------------------------------

@pytest.fixture(scope='module')
def lightning_runs(tmp_path_factory):
    """torch_lightning_runs, imported once Lightning is known to import;
    ``runs.cached(kind, **fit_kwargs)``: a run with loss_scale_settings,
    computed once (the tests only read it)."""
    framework('lightning')
    import torch_lightning_runs as runs
    root = tmp_path_factory.mktemp('lightning')

    @functools.lru_cache(maxsize=None)
    def cached(kind, **kwargs):
        return runs.fit(builder(kind), root, **kwargs)
    runs.cached = cached
    return runs


def builder(kind, **settings):
    """make_scaler for torch_lightning_runs.fit: ``kind``'s scaler for the
    module, with ``settings`` or else loss_scale_settings."""
    return lambda module: make(kind, module,
                               **(settings or loss_scale_settings(kind)))


def epoch_means(losses, n=4):
    return [sum(losses[i:i + n]) / n for i in range(0, len(losses), n)]


def assert_close_modules(a, b, **tolerances):
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, msg=name, **tolerances)


@pytest.mark.parametrize('kind', cases())
def test_lightning_16_mixed_trains_as_with_gradscaler(kind, lightning_runs):
    """Trainer with MixedPrecision('16-mixed', 'cpu', scaler=...): every
    step taken, the loss down by 3x over 3 epochs, the weights those of
    GradScaler's run (the scales are powers of two: only fp16 rounding
    of the scaled backward differs)."""
    module, record, _ = lightning_runs.cached(kind)
    means = epoch_means(record.losses)
    assert len(means) == 3 and means[-1] < means[0] / 3
    assert all(record.moved)
    reference = lightning_runs.cached(GRADSCALER)[0]
    assert_close_modules(module, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('kind', cases())
def test_lightning_resumes_through_ckpt_path_with_the_scalers_state(
        kind, lightning_runs, tmp_path):
    """2 epochs, a checkpoint, then a new Trainer and a scaler built
    otherwise resumed through ckpt_path to 3 epochs: the scaler starts
    from the checkpoint's state, and the run ends as an unbroken one,
    bit for bit."""
    ckpt = tmp_path / 'two-epochs.ckpt'
    _, _, first = lightning_runs.fit(builder(kind), tmp_path, max_epochs=2,
                                     save=ckpt)
    saved = lightning_runs.plain(first.state_dict())
    other = {'init_scale': 2.0 ** 5} if kind.single_scale else {}
    module, record, _ = lightning_runs.fit(
        builder(kind, **other), tmp_path, max_epochs=3, ckpt_path=str(ckpt))
    assert record.scaler_state_at_start == saved
    assert len(record.losses) == lightning_runs.N_BATCHES
    unbroken = lightning_runs.cached(kind)[0]
    assert_close_modules(module, unbroken, rtol=0, atol=0)


@pytest.mark.parametrize('kind', cases())
def test_lightning_accumulates_gradients(kind, lightning_runs):
    """accumulate_grad_batches=2: the weights move every second batch
    only, and end as with GradScaler."""
    module, record, _ = lightning_runs.cached(kind,
                                              accumulate_grad_batches=2)
    assert record.moved == [False, True] * 6
    reference = lightning_runs.cached(GRADSCALER,
                                      accumulate_grad_batches=2)[0]
    assert_close_modules(module, reference, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize('kind', cases())
def test_lightning_skipped_step_puts_back_batchnorm_of_an_inner_module(
        kind, lightning_runs, tmp_path):
    """A batch that overflows in fp16 (BatchNorm, inside ``self.net``,
    sees inf): the step is skipped and, with GradientScaler given the
    LightningModule, the inner BatchNorm's running statistics are put
    back, finite. GradScaler skips the step too but leaves them as the
    forward left them: not finite (the difference GS makes)."""
    _, record, _ = lightning_runs.fit(builder(kind), tmp_path, max_epochs=1,
                                      fault_step=1)
    assert record.moved == [True, False, True, True]
    before, after = record.around_watch
    stats = ('1.running_mean', '1.running_var', '1.num_batches_tracked')
    for name in before:
        if name not in stats:
            assert torch.equal(after[name], before[name]), name
    finite = all(after[s].isfinite().all() for s in stats)
    if kind is GRADSCALER:
        assert not finite
        assert after['1.num_batches_tracked'] == 2
    else:
        assert finite
        for s in stats:
            assert torch.equal(after[s], before[s]), s


@pytest.mark.slow
@pytest.mark.parametrize('kind', cases())
def test_lightning_ddp_on_two_cpu_processes(kind, tmp_path):
    """strategy='ddp', two processes (gloo), each rank its own data and
    losses; an fp16 overflow on rank 1 only: both ranks skip that step,
    take every other, and end with the same weights."""
    framework('lightning')
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, 'torch_lightning_runs.py'),
         kind.name, str(tmp_path)], capture_output=True, text=True,
        timeout=600, cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [here, os.path.dirname(here)]), OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / 'rank{}.json'.format(r)).read_text())
             for r in (0, 1)]
    steps = 2 * 4   # 2 epochs of 8 batches, 4 on each rank
    for rank in ranks:
        assert rank['moved'] == [i != 2 for i in range(steps)]
        assert all(abs(b) < float('inf') for b in rank['buffers'])
    assert ranks[0]['weights'] == ranks[1]['weights']
    assert ranks[0]['losses'] != ranks[1]['losses']


# -- Hugging Face Accelerate ------------------------------------------------

@pytest.fixture(scope='module')
def accelerate():
    """accelerate. Its state is process-wide (AcceleratorState): every
    Accelerator here is built alike, ``cpu=True, mixed_precision='fp16'``,
    which Accelerate allows again and again."""
    return framework('accelerate')


def accelerate_batches(n=4, fault=2):
    """Regression batches; batch ``fault`` overflows in fp16."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        x = torch.randn(16, 8, generator=g)
        batches.append((x * 1e6 if i == fault else x, x.sum(1, keepdim=True)))
    return batches


def regression_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


MAX_NORM = 0.5   # below these gradients' norms: the clip acts


def fp16_accelerator(accelerate, scaler):
    """``Accelerator(cpu=True, mixed_precision='fp16')``, which on the
    CPU makes no scaler and no autocast, given what it gives itself on a
    GPU (accelerator.py: ``self.scaler``, ``self.native_amp``) before
    ``prepare``, which hands the scaler to the optimizer it wraps."""
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision='fp16')
    assert accelerator.scaler is None and not accelerator.native_amp
    accelerator.scaler = scaler
    accelerator.native_amp = True     # autocast, unscale before clipping
    return accelerator


@pytest.mark.parametrize('kind', cases())
def test_accelerate_backward_clip_step_with_the_scaler(kind, accelerate,
                                                       tmp_path):
    """accelerator.backward, clip_grad_norm_ and the prepared optimizer's
    step through the scaler: the norms clipped are those of the true
    gradients (a plain fp32 run's, not 1024 times them), the fp16
    overflow's step is skipped (step_was_skipped), the weights end as the
    plain run's; save_state/load_state carry the scaler's state into a
    scaler built otherwise."""
    batches = accelerate_batches()
    control = regression_net()
    opt_control = torch.optim.SGD(control.parameters(), lr=0.05)
    norms_control = []
    for i, (x, y) in enumerate(batches):
        if i == 2:
            continue
        opt_control.zero_grad()
        torch.nn.functional.mse_loss(control(x), y).backward()
        norms_control.append(float(torch.nn.utils.clip_grad_norm_(
            control.parameters(), MAX_NORM)))
        opt_control.step()

    model = regression_net()
    accelerator = fp16_accelerator(accelerate, builder(kind)(model))
    model, optimizer = accelerator.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.05))
    norms, skipped = [], []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(),
                                                       MAX_NORM)))
        optimizer.step()
        skipped.append(optimizer.step_was_skipped)
    assert skipped == [False, False, True, False]
    del norms[2]
    assert norms == pytest.approx(norms_control, rel=1e-2)
    for p, c in zip(model.parameters(), control.parameters()):
        torch.testing.assert_close(p, c, rtol=1e-2, atol=1e-3)

    accelerator.save_state(str(tmp_path / 'state'))
    saved = json.dumps(accelerator.scaler.state_dict(), sort_keys=True)
    fresh = regression_net(seed=1)
    other = {'init_scale': 2.0 ** 5} if kind.single_scale else {}
    accelerator = fp16_accelerator(accelerate, builder(kind, **other)(fresh))
    fresh, _ = accelerator.prepare(
        fresh, torch.optim.SGD(fresh.parameters(), lr=0.05))
    accelerator.load_state(str(tmp_path / 'state'))
    assert json.dumps(accelerator.scaler.state_dict(), sort_keys=True) == \
        saved
    for p, q in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(p, q)


# -- Hugging Face transformers ------------------------------------------------

def gpt2(transformers):
    """GPT-2: its Conv1D is addmm with an untransposed weight; wte is tied
    to the LM head."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16,
        resid_pdrop=0., embd_pdrop=0., attn_pdrop=0., bos_token_id=0,
        eos_token_id=0))


def bert(transformers):
    """BERT, masked LM (word embeddings tied to the decoder)."""
    return transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, vocab_size=64, max_position_embeddings=16,
        hidden_dropout_prob=0., attention_probs_dropout_prob=0.))


def llama(transformers):
    """Llama: RMSNorm, rotary position embeddings, a gated MLP."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=0))


def vit(transformers):
    """ViT: a convolution embeds the 4x4 patches."""
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_labels=5, hidden_dropout_prob=0.,
        attention_probs_dropout_prob=0.))


def transformers_batch(name, step):
    g = torch.Generator().manual_seed(step)
    if name == 'vit':
        return {'pixel_values': torch.randn(2, 3, 8, 8, generator=g,
                                            dtype=torch.float64),
                'labels': torch.randint(0, 5, (2,), generator=g)}
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return {'input_ids': ids, 'labels': ids}


MODELS = {'gpt2': gpt2, 'bert': bert, 'llama': llama, 'vit': vit}

# The parameters of 2 or more dimensions that are no sites: they are no
# matrix product's weight, or, the patch embedding, one whose input is
# the data (no gradient leaves it to scale).
NOT_SITES = {
    'gpt2': ['transformer.wpe.weight'],
    'bert': ['bert.embeddings.position_embeddings.weight',
             'bert.embeddings.token_type_embeddings.weight'],
    'llama': ['model.embed_tokens.weight'],
    'vit': ['vit.embeddings.cls_token',
            'vit.embeddings.patch_embeddings.projection.weight',
            'vit.embeddings.position_embeddings']}
# Their Linear and Conv1D weights: 4 per block (GPT-2, tied head), 6 per
# block and the MLM transform (BERT, tied decoder), 7 per block and the
# head (Llama), 6 per block and the classifier (ViT).
GEMMS = {'gpt2': 9, 'bert': 14, 'llama': 15, 'vit': 13}


@pytest.fixture(scope='module')
def transformers():
    module = framework('transformers')
    module.logging.set_verbosity_error()
    return module


def gemm_weights(transformers, model):
    """The names of the weights of every Linear and GPT-2 Conv1D (a tied
    head's under the name of the table it shares)."""
    names = {id(p): n for n, p in model.named_parameters()}
    gemms = (torch.nn.Linear, transformers.pytorch_utils.Conv1D)
    return sorted({names[id(m.weight)] for m in model.modules()
                   if isinstance(m, gemms)})


@functools.lru_cache(maxsize=None)
def train_against_plain(kind, transformers, name, steps=2):
    """``steps`` steps of ``name`` in float64 with the loss times 2**-24,
    through the scaler; after each unscale_ the gradients must equal a
    plain backward's on a copy, bit for bit. Returns the model and the
    scaler (once per arguments: the sites test reads GS's run)."""
    torch.manual_seed(0)
    model = MODELS[name](transformers).double()
    plain = MODELS[name](transformers).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make(kind, model, **loss_scale_settings(kind))
    for step in range(steps):
        plain.load_state_dict(model.state_dict())
        batch = transformers_batch(name, step)
        (plain(**batch).loss * 2.0 ** -24).backward()
        optimizer.zero_grad()
        scaler.scale(model(**batch).loss * 2.0 ** -24).backward()
        scaler.unscale_(optimizer)
        expected = dict(plain.named_parameters())
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, expected[n].grad), (step, n)
        scaler.step(optimizer)
        scaler.update()
        plain.zero_grad()
    return model, scaler


@pytest.mark.parametrize('name', sorted(MODELS))
@pytest.mark.parametrize('kind', cases())
def test_transformers_gradients_after_unscale_are_the_plain_ones(
        kind, transformers, name):
    """float64, the loss times 2**-24: two steps whose unscaled gradients
    equal a plain backward's exactly (every scale is a power of two)."""
    train_against_plain(kind, transformers, name)


def zoo_model(transformers, name):
    """Small configurations (dropout off, no download) of architectures
    with constructs the four MODELS lack, and a loss of a batch."""
    t = transformers
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 64, (2, 12), generator=g)
    short = torch.randint(3, 64, (2, 7), generator=g)
    pixels = torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)
    lm = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, intermediate_size=48,
              max_position_embeddings=64)
    no_dropout = dict(hidden_dropout_prob=0., attention_probs_dropout_prob=0.)
    if name == 't5':  # encoder-decoder, relative attention bias, tied
        model = t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2,
            num_heads=4, dropout_rate=0., decoder_start_token_id=0))
        return model, lambda m: m(input_ids=ids, labels=short).loss
    if name == 'bart':  # shared embeddings of encoder, decoder and head
        model = t.BartForConditionalGeneration(t.BartConfig(
            vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=48, decoder_ffn_dim=48, dropout=0.,
            attention_dropout=0., activation_dropout=0.,
            max_position_embeddings=64))
        return model, lambda m: m(input_ids=ids, labels=short).loss
    if name == 'albert':  # one layer's weights shared by every layer
        model = t.AlbertForMaskedLM(t.AlbertConfig(
            embedding_size=16, **dict(lm, num_hidden_layers=3,
                                      **no_dropout)))
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    if name == 'deberta-v2':  # disentangled relative attention
        model = t.DebertaV2ForMaskedLM(t.DebertaV2Config(
            relative_attention=True, pos_att_type=['c2p', 'p2c'],
            max_relative_positions=16, **dict(lm, **no_dropout)))
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    if name == 'mixtral':  # experts: a slice of a 3-d weight per GEMM
        config = t.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, **lm)
        config._experts_implementation = 'eager'
        model = t.MixtralForCausalLM(config)
        return model, lambda m: m(input_ids=ids, labels=ids).loss
    if name == 'whisper':  # 1-d convolutions, cross attention
        model = t.WhisperForConditionalGeneration(t.WhisperConfig(
            vocab_size=64, num_mel_bins=8, encoder_layers=1,
            decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48,
            decoder_ffn_dim=48, d_model=32, max_source_positions=8,
            max_target_positions=16, decoder_start_token_id=1,
            pad_token_id=0, dropout=0., attention_dropout=0.,
            activation_dropout=0.))
        features = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
        return model, lambda m: m(input_features=features,
                                  labels=short).loss
    if name == 'clip':  # two towers, a contrastive loss
        model = t.CLIPModel(t.CLIPConfig(
            text_config=dict(lm, max_position_embeddings=16),
            vision_config=dict(hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=48,
                               image_size=16, patch_size=8),
            projection_dim=16))
        return model, lambda m: m(input_ids=ids[:, :10],
                                  pixel_values=pixels[..., :16, :16],
                                  return_loss=True).loss
    if name == 'swin':  # shifted windows (roll), patch merging
        model = t.SwinForImageClassification(t.SwinConfig(
            image_size=32, patch_size=4, embed_dim=16, depths=[2, 2],
            num_heads=[2, 4], window_size=4, num_labels=5,
            drop_path_rate=0., **no_dropout))
        return model, lambda m: m(pixel_values=pixels,
                                  labels=torch.tensor([1, 3])).loss
    if name == 'wav2vec2':  # strided convolutions, group norm, CTC
        model = t.Wav2Vec2ForCTC(t.Wav2Vec2Config(
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
            feat_extract_norm='group', mask_time_prob=0., layerdrop=0.,
            hidden_dropout=0., activation_dropout=0., attention_dropout=0.,
            feat_proj_dropout=0., final_dropout=0.,
            **dict(lm, vocab_size=64)))
        wave = torch.randn(2, 400, generator=g, dtype=torch.float64)
        return model, lambda m: m(input_values=wave,
                                  labels=short[:, :5]).loss
    if name == 'segformer':  # batch norm, upsampling, pixel labels
        model = t.SegformerForSemanticSegmentation(t.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
            hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
            num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=16, num_labels=4, drop_path_rate=0.,
            classifier_dropout_prob=0., **no_dropout))
        labels = torch.randint(0, 4, (2, 16, 16), generator=g)
        return model, lambda m: m(pixel_values=pixels[..., :16, :16],
                                  labels=labels).loss
    assert name == 'mamba'  # a selective scan in PyTorch operations
    model = t.MambaForCausalLM(t.MambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2,
        expand=2, conv_kernel=3, use_mambapy=False))
    return model, lambda m: m(input_ids=ids[:, :6], labels=ids[:, :6]).loss


def checkpointed(model, checkpointing):
    """``model`` in training mode, its layers checkpointed by Hugging
    Face's own switch where ``checkpointing`` says how (``'reentrant'``,
    ``'non-reentrant'``)."""
    if checkpointing:
        kwargs = {'use_reentrant': checkpointing == 'reentrant'}
        if hasattr(model, 'activation_checkpointing_enable'):  # (v5.2 on)
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=kwargs)
    return model.train()


ZOO = ['albert', 'bart', 'clip', 'deberta-v2', 'mamba', 'mixtral',
       'segformer', 'swin', 't5', 'wav2vec2', 'whisper']


@pytest.mark.parametrize('name,checkpointing', [
    (name, None) for name in ZOO] + [
    ('t5', 'reentrant'), ('bart', 'reentrant'), ('swin', 'reentrant'),
    ('whisper', 'non-reentrant')])
def test_transformers_zoo_gradients_are_the_plain_ones(
        transformers, name, checkpointing):
    """GS on architectures none of the tests above builds, several with
    Hugging Face's gradient checkpointing: float64, the loss times
    2**-24 (so that the sites scale: some by 2**8 or more), 3 steps at
    interval 2 (refreshes and a cached pass), the gradients after each
    backward equal to a plain backward's on a copy, bit for bit."""
    torch.manual_seed(0)
    model, loss_of = zoo_model(transformers, name)
    model = checkpointed(model.double(), checkpointing)
    plain = checkpointed(zoo_model(transformers, name)[0].double(),
                         checkpointing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = make(GS, model, update_interval=2)
    for step in range(3):
        plain.load_state_dict(model.state_dict())
        plain.zero_grad(set_to_none=True)
        (loss_of(plain) * 2.0 ** -24).backward()
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_of(model) * 2.0 ** -24).backward()
        expected = dict(plain.named_parameters())
        for n, p in model.named_parameters():
            q = expected[n].grad
            assert (p.grad is None) == (q is None), (step, n)
            assert q is None or torch.equal(p.grad, q), (step, n)
        scaler.step(optimizer)
        assert scaler.step_taken, step
        scaler.update()
    scales = [r.local_scale for r in scaler.report()]
    assert len(scales) >= 4 and max(scales) >= 2.0 ** 8, scales


@pytest.mark.parametrize('name,dynamic', [
    ('bart', None), ('clip', None), ('wav2vec2', None), ('bart', True)],
    ids=['bart', 'clip', 'wav2vec2', 'bart-dynamic'])
def test_transformers_compiled_whole_scale_as_eager_gs(transformers, name,
                                                       dynamic):
    """A Hugging Face model compiled whole with GS's backend (aot_eager),
    which returns its logits (and, for CLIP, embeddings) beside the loss
    that alone is given a gradient: every scale eager GS chooses at each
    step (the logits' GEMM the cast site, BART's tied table; CLIP's
    contrastive pair; Wav2Vec2's CTC loss, whose log-softmax Dynamo
    compiles as a region of its own after a graph break behind
    ``lm_head``), and the gradients of the model compiled without GS, bit
    for bit (float64, the loss times 2**-24, 3 steps at interval 2).
    ``dynamic``: compiled with dynamic shapes (the logits' sizes and
    strides symbolic), as Dynamo compiles again after a batch of another
    length."""
    import copy
    from gradient_scaling.torch.compile_backend import compile_backend
    torch.compiler.reset()
    torch.manual_seed(0)
    base, loss_of = zoo_model(transformers, name)
    base = base.double().train()
    models = {k: copy.deepcopy(base) for k in ('plain', 'eager', 'gs')}
    scalers = {k: make(GS, models[k], update_interval=2)
               for k in ('eager', 'gs')}
    runs = {'plain': torch.compile(models['plain'], backend='aot_eager',
                                   dynamic=dynamic),
            'eager': models['eager'],
            'gs': torch.compile(models['gs'], dynamic=dynamic,
                                backend=compile_backend(
                                    scalers['gs'], inner='aot_eager'))}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.05)
                  for k, m in models.items()}
    for step in range(3):
        for k, run in runs.items():
            optimizers[k].zero_grad(set_to_none=True)
            loss = loss_of(run) * 2.0 ** -24
            if k == 'plain':
                loss.backward()
                optimizers[k].step()
            else:
                scalers[k].scale(loss).backward()
        grads = {k: {n: p.grad for n, p in m.named_parameters()}
                 for k, m in models.items()}
        for n, q in grads['plain'].items():
            p = grads['gs'][n]
            assert (p is None) == (q is None), (step, n)
            assert q is None or torch.equal(p, q), (step, n)
        for k in scalers:
            scalers[k].step(optimizers[k])
            assert scalers[k].step_taken
            scalers[k].update()
        expected = scalers['eager'].site_scales()
        assert scalers['gs'].site_scales() == expected, step
    assert max(expected.values()) >= 2.0 ** 8
    assert ('cast#0' in expected) == (name != 'clip')  # (CLIP: no head)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_transformers_planned_passes_are_the_python_callbacks(
        transformers, name, monkeypatch):
    """GS's cached passes planned (their sites and landing native:
    gradient_scaling/torch/planned_pass.py) against the Python callbacks
    on each model: 8 steps at interval 3 with an optimizer (refreshes,
    the recorded passes, planned ones), float64, the gradients bit for
    bit and the same report."""
    from gradient_scaling.torch import native
    from gradient_scaling.torch import planned_pass
    if native.planned() is None:
        pytest.skip('native module not built: ' + native.reason())
    planned_runs = []
    start = planned_pass.PlannedRun.start

    def counted(self):
        start(self)
        planned_runs.append(self.table.mode)
    monkeypatch.setattr(planned_pass.PlannedRun, 'start', counted)

    def run(planned):
        torch.manual_seed(0)
        model = MODELS[name](transformers).double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = make(GS, model, update_interval=3)
        scaler.hook.planned_passes = planned
        grads = []
        for step in range(8):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(model(**transformers_batch(name, step)).loss) \
                .backward()
            grads.append({n: p.grad.clone()
                          for n, p in model.named_parameters()
                          if p.grad is not None})
            scaler.step(optimizer)
            scaler.update()
        return grads, [(r.name, r.local_scale, r.output_scale)
                       for r in scaler.report()]
    planned, python = run(True), run(False)
    assert planned_runs == [1, 1, 1, 1]  # steps 2, 4, 5, 7
    assert planned[1] == python[1]
    for step, (a, b) in enumerate(zip(planned[0], python[0])):
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n]), (step, n)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_transformers_every_matrix_product_weight_is_a_site(transformers,
                                                           name):
    """GS in mode 'gs': every Linear and Conv1D weight (GPT-2's addmm with
    the untransposed weight, tied heads, Llama's gated MLP, BERT's and
    ViT's attention) names a site of ``report()``; the parameters of 2
    or more dimensions that do not are the embedding tables and the
    patch convolution (NOT_SITES)."""
    model, scaler = train_against_plain(GS, transformers, name)
    sites = {record.name for record in scaler.report()}
    weights = gemm_weights(transformers, model)
    assert len(weights) == GEMMS[name]
    assert set(weights) <= sites
    assert sorted(n for n, p in model.named_parameters()
                  if p.dim() >= 2 and n not in sites) == NOT_SITES[name]
