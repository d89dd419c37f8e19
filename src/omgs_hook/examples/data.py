"""Offline data sets for the example models - nothing is downloaded at run time.

Image classification (``resnet20``, ``vgg16``):

* :func:`digits` - scikit-learn's bundled handwritten digits (1,797 real 8x8 grayscale
  images, 10 classes). Split into train/test by a stratified, seeded shuffle (the same
  split on every rank and every run), scaled to [0, 1] and standardised with the
  *training* set's mean and standard deviation. ``image_size`` upsamples bilinearly
  (e.g. to the 32x32 that CIFAR-shaped models expect) and ``channels=3`` repeats the
  gray channel, so the same models run unchanged on CIFAR-shaped tensors.
* :func:`synthetic_images` - random CIFAR-shaped (3x32x32) inputs with random labels
  from a seeded generator: for timing runs where accuracy does not matter.

Character-level language modelling (``lstm``):

* :func:`stdlib_text` / :func:`text_corpus` - the concatenated source text of a few
  Python standard-library modules, read from this interpreter's own installation (real
  English-and-code text that ships with Python). The vocabulary is the sorted set of
  characters of the corpus; the token stream is cut into non-overlapping windows of
  ``seq_len + 1`` characters (input = first ``seq_len``, target = shifted by one). The
  *last* ``test_fraction`` of the windows is the test set, so test text never overlaps
  training text.
* :func:`synthetic_tokens` - uniformly random tokens from a seeded generator.

Every function returns a :class:`Dataset` with in-memory tensors: ``train_inputs``,
``train_targets``, ``test_inputs``, ``test_targets`` and a few facts the model needs
(``num_classes`` for images, ``vocab`` for text). :func:`shard_batches` turns the
training set into this rank's mini-batches via ``torch.utils.data.DistributedSampler``.
"""

import importlib.util
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

# Standard-library modules whose source makes up the default text corpus (~485 KB on
# CPython 3.11): prose-heavy docstrings plus code, all present in every CPython install.
DEFAULT_TEXT_MODULES = ("argparse", "inspect", "difflib", "typing", "dataclasses")
# A corpus about 3.6x larger (~1.75 MB on CPython 3.11): the default modules plus fifteen
# more. The LSTM convergence study uses it so that a schedule long enough for density
# 0.001 to catch up does not overfit (docs/convergence.md). Its held-out tail (10%) is
# ``locale``, ``mailbox`` and the end of ``datetime``: text of modules never trained on.
LARGE_TEXT_MODULES = DEFAULT_TEXT_MODULES + (
    "pydoc", "tarfile", "subprocess", "_pydecimal", "shutil", "pathlib", "configparser",
    "pickle", "enum", "threading", "logging", "zipfile", "datetime", "mailbox", "locale")
TEXT_CORPORA = {"small": DEFAULT_TEXT_MODULES, "large": LARGE_TEXT_MODULES}

DIGITS_CLASSES = 10


@dataclass
class Dataset:
    """In-memory train/test tensors plus what a model needs to know about them.

    ``kind`` is ``"images"`` (inputs float (N, C, H, W), targets int64 (N,)) or
    ``"text"`` (inputs and targets int64 (N, seq_len); targets are inputs shifted by one).
    ``num_classes`` is the number of classes (images) or the vocabulary size (text);
    ``vocab`` is the string of characters for token ids 0..V-1 (text data only).
    """

    name: str
    kind: str
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor
    num_classes: int
    vocab: str = ""
    info: dict = field(default_factory=dict)

    @property
    def in_channels(self):
        """Image channels (images only)."""
        if self.kind != "images":
            raise AttributeError(f"{self.name} is a {self.kind} data set: no in_channels")
        return self.train_inputs.shape[1]

    @property
    def num_train(self):
        return self.train_inputs.shape[0]

    @property
    def num_test(self):
        return self.test_inputs.shape[0]


def _require_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _require_fraction(name, value):
    if not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name}: must be a number strictly between 0 and 1, got {value!r}")


def _stratified_split(labels, test_fraction, seed):
    """Index arrays (train, test) holding out ``test_fraction`` of every class.

    Our own few lines instead of sklearn.model_selection, whose import alone costs
    about a second per rank at start-up.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        held_out = int(round(test_fraction * members.size))
        test.append(members[:held_out])
        train.append(members[held_out:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def _resize(images, image_size, channels):
    """Bilinear resize to ``image_size`` and repeat the gray channel to ``channels``."""
    if image_size != images.shape[-1]:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False)
    if channels == 3:
        images = images.repeat(1, 3, 1, 1)
    return images.contiguous()


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # inside the sklearn package
DIGITS_COUNT = 1797


def _digits_arrays():
    """The digits as ``(images (1797, 8, 8) float64, target (1797,) int)``, exactly what
    ``sklearn.datasets.load_digits()`` returns as ``images`` and ``target``.

    Read straight from the data file scikit-learn ships (a gzipped CSV, 64 pixels and
    the label per row), the way scikit-learn itself parses it: importing sklearn costs
    about 2 s of CPU, paid by every rank of every launch. Falls back to ``load_digits``
    when the file is not where this expects it (another scikit-learn layout).
    """
    import gzip

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None:
        raise ImportError("the digits data set comes with scikit-learn, which is not "
                          "installed: pip install -e '.[scripts]' (or use synthetic data)")
    for root in spec.submodule_search_locations or []:
        path = os.path.join(root, *DIGITS_FILE)
        if os.path.isfile(path):
            with gzip.open(path, "rt", encoding="utf-8") as handle:
                data = np.loadtxt(handle, delimiter=",")
            if data.shape == (DIGITS_COUNT, 65):
                return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target


def digits(image_size=8, channels=1, test_fraction=0.2, split_seed=0):
    """scikit-learn's bundled 8x8 digits as a normalised, deterministic train/test split.

    Args:
        image_size: side length of the returned images; 8 keeps the originals, larger
            values upsample bilinearly (32 for CIFAR-shaped models such as ``vgg16``).
        channels: 1 (gray) or 3 (gray repeated, for models built for RGB input).
        test_fraction: share of the 1,797 images held out for testing (stratified by
            class, so every digit is represented in both parts).
        split_seed: seed of the split; the default gives the same split everywhere.
    """
    _require_positive_int("image_size", image_size)
    if image_size < 4:
        raise ValueError(f"image_size: must be at least 4 pixels, got {image_size}")
    if channels not in (1, 3):
        raise ValueError(f"channels: must be 1 or 3, got {channels!r}")
    _require_fraction("test_fraction", test_fraction)
    images, target = _digits_arrays()
    images = images.astype("float32") / 16.0  # pixel values are 0..16
    train_index, test_index = _stratified_split(target, test_fraction, split_seed)
    train_x, train_y = images[train_index], target[train_index]
    test_x, test_y = images[test_index], target[test_index]
    train_x = torch.from_numpy(train_x).unsqueeze(1)
    test_x = torch.from_numpy(test_x).unsqueeze(1)
    # statistics of the training part only, so no test information leaks into training
    mean, std = train_x.mean(), train_x.std()
    train_x = _resize((train_x - mean) / std, image_size, channels)
    test_x = _resize((test_x - mean) / std, image_size, channels)
    return Dataset(
        name="digits", kind="images",
        train_inputs=train_x, train_targets=torch.from_numpy(train_y).long(),
        test_inputs=test_x, test_targets=torch.from_numpy(test_y).long(),
        num_classes=DIGITS_CLASSES,
        info={"source": "sklearn.datasets.load_digits", "mean": float(mean),
              "std": float(std), "image_size": image_size},
    )


def synthetic_images(num_train=1024, num_test=256, channels=3, image_size=32,
                     num_classes=10, seed=0):
    """Random CIFAR-shaped images with random labels (timing runs; not learnable)."""
    for name, value in (("num_train", num_train), ("num_test", num_test),
                        ("channels", channels), ("image_size", image_size),
                        ("num_classes", num_classes)):
        _require_positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    total = num_train + num_test
    inputs = torch.randn(total, channels, image_size, image_size, generator=generator)
    targets = torch.randint(0, num_classes, (total,), generator=generator)
    return Dataset(
        name="synthetic-images", kind="images",
        train_inputs=inputs[:num_train], train_targets=targets[:num_train],
        test_inputs=inputs[num_train:], test_targets=targets[num_train:],
        num_classes=num_classes, info={"seed": seed},
    )


def stdlib_text(modules=DEFAULT_TEXT_MODULES):
    """Concatenated source text of the given standard-library modules, read from disk."""
    if not modules:
        raise ValueError("modules: need at least one module name")
    parts = []
    for module_name in modules:
        spec = importlib.util.find_spec(module_name)
        origin = getattr(spec, "origin", None)
        if origin is None or not origin.endswith(".py"):
            raise ValueError(f"modules: {module_name!r} has no Python source file on this "
                             f"installation (origin: {origin!r})")
        with open(origin, encoding="utf-8") as handle:
            parts.append(handle.read())
    return "\n".join(parts)


def _windows(tokens, seq_len):
    """Cut a 1-D token stream into (inputs, targets) windows of seq_len, shifted by one."""
    count = (tokens.numel() - 1) // seq_len
    inputs = tokens[: count * seq_len].view(count, seq_len)
    targets = tokens[1: count * seq_len + 1].view(count, seq_len)
    return inputs.clone(), targets.clone()


def text_corpus(seq_len=64, test_fraction=0.1, modules=DEFAULT_TEXT_MODULES, text=None):
    """Character-level language-modelling data from standard-library source text.

    Args:
        seq_len: characters per training sequence.
        test_fraction: share of the windows, taken from the end of the text, held out.
        modules: standard-library modules whose source forms the corpus.
        text: use this string instead of reading ``modules`` (for tests and own corpora).
    """
    _require_positive_int("seq_len", seq_len)
    _require_fraction("test_fraction", test_fraction)
    read_modules = text is None
    if read_modules:
        text = stdlib_text(modules)
    vocab = "".join(sorted(set(text)))
    lookup = {char: index for index, char in enumerate(vocab)}
    tokens = torch.tensor([lookup[char] for char in text], dtype=torch.int64)
    inputs, targets = _windows(tokens, seq_len)
    num_test = max(1, int(round(test_fraction * inputs.shape[0])))
    if inputs.shape[0] - num_test < 1:
        raise ValueError(f"text of {len(text)} characters is too short for seq_len={seq_len}")
    return Dataset(
        name="stdlib-text", kind="text",
        train_inputs=inputs[:-num_test], train_targets=targets[:-num_test],
        test_inputs=inputs[-num_test:], test_targets=targets[-num_test:],
        num_classes=len(vocab), vocab=vocab,
        info={"modules": list(modules) if read_modules else None, "characters": len(text)},
    )


def synthetic_tokens(num_train=1024, num_test=128, seq_len=64, vocab_size=64, seed=0):
    """Uniformly random token windows (timing runs for the LSTM; not learnable)."""
    for name, value in (("num_train", num_train), ("num_test", num_test),
                        ("seq_len", seq_len), ("vocab_size", vocab_size)):
        _require_positive_int(name, value)
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab_size, ((num_train + num_test) * seq_len + 1,),
                           generator=generator)
    inputs, targets = _windows(stream, seq_len)
    return Dataset(
        name="synthetic-tokens", kind="text",
        train_inputs=inputs[:num_train], train_targets=targets[:num_train],
        test_inputs=inputs[num_train:], test_targets=targets[num_train:],
        num_classes=vocab_size, vocab="", info={"seed": seed},
    )


def make_sampler(num_samples, world_size, rank, seed, shuffle=True):
    """DistributedSampler over ``num_samples`` items; drop_last keeps shards equal-sized."""
    # DistributedSampler only needs len(); a range stands in for the data set.
    return DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank,
                              shuffle=shuffle, seed=seed, drop_last=True)


def steps_per_epoch(num_samples, world_size, batch_size):
    """Full mini-batches each rank gets per epoch (incomplete last batches are dropped)."""
    per_rank = num_samples // world_size
    steps = per_rank // batch_size
    if steps < 1:
        raise ValueError(f"batch_size {batch_size} x world_size {world_size} exceeds the "
                         f"{num_samples} training samples: no full batch per rank")
    return steps


def shard_batches(dataset, sampler, epoch, batch_size, start_step=0):
    """Yield (inputs, targets) mini-batches of this rank for ``epoch``.

    The order depends only on (sampler seed, epoch, rank), never on global RNG state,
    so a run resumed at ``start_step`` of an epoch sees exactly the batches that the
    uninterrupted run saw. Incomplete final batches are dropped so every rank runs the
    same number of steps (a rank with one step more would wait in all-reduce forever).
    """
    sampler.set_epoch(epoch)
    indices = torch.tensor(list(iter(sampler)), dtype=torch.int64)
    steps = indices.numel() // batch_size
    for step in range(start_step, steps):
        batch = indices[step * batch_size:(step + 1) * batch_size]
        yield dataset.train_inputs[batch], dataset.train_targets[batch]


def test_shard(dataset, world_size, rank):
    """This rank's share of the test set: every world_size-th sample, no padding.

    Unlike DistributedSampler this duplicates nothing, so summing correct counts over
    ranks gives the exact test accuracy.
    """
    return dataset.test_inputs[rank::world_size], dataset.test_targets[rank::world_size]


def describe(dataset):
    """One-line human description of a data set."""
    if dataset.kind == "images":
        shape = "x".join(str(s) for s in dataset.train_inputs.shape[1:])
        return (f"{dataset.name}: {dataset.num_train} train / {dataset.num_test} test images "
                f"of {shape}, {dataset.num_classes} classes")
    return (f"{dataset.name}: {dataset.num_train} train / {dataset.num_test} test windows of "
            f"{dataset.train_inputs.shape[1]} tokens, vocabulary {dataset.num_classes}")


__all__ = ["Dataset", "DEFAULT_TEXT_MODULES", "digits", "synthetic_images", "stdlib_text",
           "text_corpus", "synthetic_tokens", "make_sampler", "steps_per_epoch",
           "shard_batches", "test_shard", "describe"]
