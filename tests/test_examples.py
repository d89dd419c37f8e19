"""Example models (parameter counts, shapes, gradients) and offline data sets."""

import pytest
import torch
import torch.nn as nn

from omgs_hook.examples import data as D
from omgs_hook.examples.models import (
    MODEL_NAMES, build_model, count_parameters, lstm, resnet20, vgg16)


# ----------------------------------------------------------------------------- models


def test_resnet20_matches_the_paper():
    model = resnet20()
    # He et al. 2016, CIFAR ResNet-20 with option-A shortcuts: 0.27M parameters
    assert count_parameters(model) == 269_722
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 20
    assert all(c.kernel_size == (3, 3) for c in convs)
    assert sorted({c.out_channels for c in convs}) == [16, 32, 64]


def test_resnet20_channels_classes_and_resolution():
    model = resnet20(in_channels=1, num_classes=7)
    # stem 3->1 input channel saves 2*16*9 weights; 64->7 head instead of 64->10
    assert count_parameters(model) == 269_722 - 2 * 16 * 9 - 3 * 64 - 3
    for size in (8, 16, 32):
        assert model(torch.randn(2, 1, size, size)).shape == (2, 7)


def test_vgg16_layout_and_size():
    model = vgg16()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) == 13 and len(linears) == 3
    assert [(l.in_features, l.out_features) for l in linears] == [
        (512, 4096), (4096, 4096), (4096, 10)]
    assert count_parameters(model) == 33_642_442
    assert count_parameters(vgg16(fc_width=2048)) == 19_986_378
    model.eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_vgg16_rejects_inputs_it_cannot_pool():
    model = vgg16(in_channels=1, fc_width=64)
    with pytest.raises(ValueError, match="multiple of 32"):
        model(torch.randn(1, 1, 16, 16))


def test_lstm_shapes_and_parameter_count():
    vocab, emb, hidden = 50, 16, 32
    model = lstm(vocab, embedding_dim=emb, hidden_size=hidden, num_layers=2)
    expected = (vocab * emb                          # embedding
                + 4 * hidden * (emb + hidden + 2)    # layer 1: W_ih, W_hh, two biases
                + 4 * hidden * (2 * hidden + 2)      # layer 2
                + hidden * vocab + vocab)            # decoder
    assert count_parameters(model) == expected
    tokens = torch.randint(0, vocab, (3, 11))
    assert model(tokens).shape == (3, 11, vocab)
    with pytest.raises(ValueError, match="batch, seq_len"):
        model(torch.randint(0, vocab, (11,)))


@pytest.mark.parametrize("name,options,inputs", [
    ("resnet20", {"in_channels": 1}, torch.randn(4, 1, 8, 8)),
    ("vgg16", {"fc_width": 32, "dropout": 0.0}, torch.randn(2, 3, 32, 32)),
    ("lstm", {"vocab_size": 20, "hidden_size": 16, "embedding_dim": 8},
     torch.randint(0, 20, (2, 5))),
])
def test_every_parameter_gets_a_gradient(name, options, inputs):
    # DDP expects every parameter to be used in every step
    torch.manual_seed(0)
    model = build_model(name, **options)
    model(inputs).float().sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


def test_models_are_reproducible_from_the_seed():
    torch.manual_seed(3)
    first = resnet20().state_dict()
    torch.manual_seed(3)
    second = resnet20().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_build_model_errors_name_the_problem():
    with pytest.raises(ValueError, match="resnet20, vgg16, lstm"):
        build_model("resnet50")
    with pytest.raises(ValueError, match="num_classes"):
        build_model("resnet20", num_classes=0)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("lstm", vocab_size=-1)
    with pytest.raises(ValueError, match="dropout"):
        build_model("vgg16", dropout=1.5)
    assert MODEL_NAMES == ("resnet20", "vgg16", "lstm")


# ------------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def digits8():
    return D.digits()


def test_digits_split_is_stratified_normalised_and_deterministic(digits8):
    d = digits8
    assert d.kind == "images" and d.num_classes == 10 and d.in_channels == 1
    assert d.num_train + d.num_test == 1797
    assert d.train_inputs.shape[1:] == (1, 8, 8) and d.train_inputs.dtype == torch.float32
    assert abs(d.num_test - 0.2 * 1797) < 10
    # every class in both parts, in roughly the data set's proportions
    assert d.test_targets.bincount(minlength=10).min() >= 34
    assert d.train_targets.bincount(minlength=10).min() >= 135
    # standardised with the training set's own statistics
    assert abs(float(d.train_inputs.mean())) < 1e-4
    assert abs(float(d.train_inputs.std()) - 1.0) < 1e-3
    again = D.digits()
    assert torch.equal(again.train_inputs, d.train_inputs)
    assert torch.equal(again.test_targets, d.test_targets)
    other = D.digits(split_seed=1)
    assert not torch.equal(other.test_targets, d.test_targets)


def test_digits_upsampled_and_rgb(digits8):
    big = D.digits(image_size=32, channels=3)
    assert big.train_inputs.shape == (digits8.num_train, 3, 32, 32)
    assert torch.equal(big.train_inputs[:, 0], big.train_inputs[:, 2])
    # upsampling keeps the picture: 4x4 block averages track the 8x8 originals closely
    pooled = torch.nn.functional.avg_pool2d(big.train_inputs[:, :1], 4).flatten()
    correlation = torch.corrcoef(torch.stack([pooled, digits8.train_inputs.flatten()]))[0, 1]
    assert correlation > 0.95
    assert torch.equal(big.train_targets, digits8.train_targets)


def test_digits_are_read_without_importing_sklearn_and_equal_its_loader():
    """The data file is parsed as scikit-learn parses it (every rank of every launch
    saved its import); the arrays are scikit-learn's own, bit for bit."""
    import subprocess
    import sys

    probe = ("import sys; from omgs_hook.examples import data; d = data.digits(); "
             "assert d.num_train + d.num_test == 1797; print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    from sklearn.datasets import load_digits

    images, target = D._digits_arrays()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and (images == bunch.images).all()
    assert (target == bunch.target).all() and target.dtype == bunch.target.dtype


@pytest.mark.parametrize("kwargs,field", [
    ({"image_size": 2}, "image_size"), ({"channels": 2}, "channels"),
    ({"test_fraction": 1.0}, "test_fraction"), ({"image_size": 8.5}, "image_size"),
])
def test_digits_rejects_bad_options(kwargs, field):
    with pytest.raises(ValueError, match=field):
        D.digits(**kwargs)


def test_text_windows_are_shifted_by_one_and_decode_to_the_text():
    text = "hello world, this is a tiny corpus.\n" * 6
    d = D.text_corpus(seq_len=8, test_fraction=0.25, text=text)
    assert d.kind == "text" and d.vocab == "".join(sorted(set(text)))
    assert d.num_classes == len(d.vocab)
    inputs = torch.cat([d.train_inputs, d.test_inputs])
    targets = torch.cat([d.train_targets, d.test_targets])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[:-1, -1], inputs[1:, 0])  # windows are consecutive
    decoded = "".join(d.vocab[i] for i in inputs.flatten().tolist())
    assert text.startswith(decoded)
    assert d.num_test == round(0.25 * inputs.shape[0])  # test = the tail of the text


def test_stdlib_corpus_is_read_from_this_python():
    import argparse

    with open(argparse.__file__, encoding="utf-8") as handle:
        source = handle.read()
    assert D.stdlib_text(("argparse",)) == source
    d = D.text_corpus(seq_len=64)
    assert d.num_train > 5000 and 60 < d.num_classes < 130
    assert d.train_inputs.shape[1] == 64 and d.train_inputs.dtype == torch.int64
    with pytest.raises(ValueError, match="no Python source"):
        D.stdlib_text(("sys",))  # built into the interpreter, no .py file
    assert d.info["modules"] == list(D.DEFAULT_TEXT_MODULES)


def test_the_large_corpus_holds_the_small_one_and_holds_out_modules_never_trained_on():
    small, large = D.text_corpus(seq_len=64), D.text_corpus(seq_len=64,
                                                            modules=D.LARGE_TEXT_MODULES)
    assert D.LARGE_TEXT_MODULES[:len(D.DEFAULT_TEXT_MODULES)] == D.DEFAULT_TEXT_MODULES
    assert large.num_train > 3 * small.num_train
    # the held-out tail (10% of the windows) lies inside the last three modules, and
    # takes all of the last two (locale, mailbox): modules never trained on
    def length(modules):
        return sum(len(D.stdlib_text((m,))) + 1 for m in modules)

    held_out = large.test_inputs.numel()
    assert length(D.LARGE_TEXT_MODULES[-2:]) < held_out < length(D.LARGE_TEXT_MODULES[-3:])


def test_synthetic_data_is_seeded():
    a, b = D.synthetic_images(seed=1), D.synthetic_images(seed=1)
    assert a.train_inputs.shape == (1024, 3, 32, 32)
    assert torch.equal(a.train_inputs, b.train_inputs)
    assert not torch.equal(a.train_inputs, D.synthetic_images(seed=2).train_inputs)
    t = D.synthetic_tokens(num_train=10, num_test=2, seq_len=5, vocab_size=7, seed=4)
    assert t.train_inputs.shape == (10, 5) and int(t.train_inputs.max()) < 7
    assert torch.equal(t.train_inputs, D.synthetic_tokens(num_train=10, num_test=2, seq_len=5,
                                                          vocab_size=7, seed=4).train_inputs)


def _batches(dataset, world, rank, epoch, batch_size, start_step=0):
    sampler = D.make_sampler(dataset.num_train, world, rank, seed=0)
    return list(D.shard_batches(dataset, sampler, epoch, batch_size, start_step=start_step))


def test_ranks_get_disjoint_equal_shards():
    d = D.synthetic_images(num_train=103, num_test=5, image_size=4)
    # tag each sample by its index so batches can be traced back
    d.train_targets = torch.arange(d.num_train)
    steps = D.steps_per_epoch(d.num_train, 2, 8)
    seen = []
    for rank in (0, 1):
        batches = _batches(d, 2, rank, epoch=0, batch_size=8)
        assert len(batches) == steps == 6
        assert all(x.shape == (8, 3, 4, 4) for x, _ in batches)
        seen.append(torch.cat([y for _, y in batches]))
    assert len(set(seen[0].tolist()) & set(seen[1].tolist())) == 0
    assert len(set(seen[0].tolist()) | set(seen[1].tolist())) == 2 * steps * 8


def test_batch_order_depends_on_epoch_only_and_resumes_midway():
    d = D.synthetic_images(num_train=64, num_test=4, image_size=4)
    d.train_targets = torch.arange(d.num_train)
    first = _batches(d, 2, 0, epoch=0, batch_size=4)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, _batches(d, 2, 0, 0, 4)))
    other_epoch = _batches(d, 2, 0, epoch=1, batch_size=4)
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, other_epoch))
    torch.manual_seed(123)  # global RNG state must not matter
    resumed = _batches(d, 2, 0, epoch=0, batch_size=4, start_step=5)
    assert [y.tolist() for _, y in resumed] == [y.tolist() for _, y in first[5:]]


def test_test_shards_cover_the_test_set_once():
    d = D.synthetic_images(num_train=8, num_test=11, image_size=4)
    d.test_targets = torch.arange(11)
    parts = [D.test_shard(d, 4, rank)[1] for rank in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(11))


def test_steps_per_epoch_rejects_too_large_batches():
    assert D.steps_per_epoch(1438, 2, 32) == 22
    with pytest.raises(ValueError, match="batch_size"):
        D.steps_per_epoch(100, 4, 32)
