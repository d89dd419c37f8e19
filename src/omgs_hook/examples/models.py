"""Example models for ``scripts/train.py`` and the benchmarks (no torchvision needed).

Three models with very different gradient layouts, so that the merge planner has
something to decide:

``resnet20``
    The CIFAR ResNet-20 of He et al. (2016), section 4.2: a 3x3 stem convolution with
    16 channels, then three stages of three basic blocks (two 3x3 convolutions each)
    with 16, 32 and 64 channels, global average pooling and one linear layer. The
    first block of stages 2 and 3 halves the resolution with a stride-2 convolution;
    its shortcut is the paper's parameter-free "option A" (subsample by 2, pad the new
    channels with zeros), which is what keeps the model at ~0.27M parameters
    (269,722 for 3 input channels and 10 classes). Many small tensors: the case where
    per-message start-up latency dominates and merging pays most.

``vgg16``
    The 13 convolutions of VGG-16 (configuration "D" of Simonyan & Zisserman, with
    batch normalisation after each convolution) on 32x32 inputs, followed by the
    classic fully-connected head ``512 -> fc_width -> fc_width -> classes``. With the
    default ``fc_width=4096`` this is ~33.6M parameters, ~56% of them in one
    4096x4096 matrix: a few huge tensors, where top-k cost and bandwidth dominate.
    ``fc_width=2048`` gives ~20M parameters.

``lstm``
    A character-level language model: embedding, a 2-layer LSTM and a linear decoder
    that predicts the next character at every position. Recurrent weights arrive
    late and all at once in backward, unlike the CNNs' layer-by-layer gradients.

:func:`build_model` maps the names above (``MODEL_NAMES``) to these constructors.
All constructors validate their arguments and raise ``ValueError`` naming the bad one.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_NAMES = ("resnet20", "vgg16", "lstm")

# VGG-16 convolution widths; "M" is a 2x2 max-pool. Five pools take 32x32 down to 1x1.
VGG16_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
                512, 512, 512, "M")


def _require_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def _require_probability(name, value):
    if not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name}: must be a number in [0, 1), got {value!r}")


def count_parameters(model):
    """Number of trainable scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------
# ResNet-20
# ---------------------------------------------------------------------------------


class _ZeroPadShortcut(nn.Module):
    """He et al.'s option-A shortcut: stride-2 subsampling plus zero channels.

    Parameter-free, so ResNet-20 keeps the paper's parameter count.
    """

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def forward(self, x):
        x = x[:, :, :: self.stride, :: self.stride]
        # pad the channel dimension (third from last in F.pad's reversed order)
        return F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        if stride != 1 or in_channels != out_channels:
            self.shortcut = _ZeroPadShortcut(in_channels, out_channels, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """CIFAR-style ResNet with ``6 * blocks_per_stage + 2`` layers (20 for 3 blocks).

    Works for any input of at least 4x4 pixels (the two stride-2 stages need it);
    global average pooling makes the head independent of the resolution.
    """

    def __init__(self, blocks_per_stage=3, in_channels=3, num_classes=10, widths=(16, 32, 64)):
        super().__init__()
        _require_positive_int("blocks_per_stage", blocks_per_stage)
        _require_positive_int("in_channels", in_channels)
        _require_positive_int("num_classes", num_classes)
        self.conv = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        stages = []
        channels = widths[0]
        for stage_index, width in enumerate(widths):
            for block_index in range(blocks_per_stage):
                stride = 2 if stage_index > 0 and block_index == 0 else 1
                stages.append(BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*stages)
        self.fc = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        out = F.relu(self.bn(self.conv(x)))
        out = self.blocks(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def resnet20(in_channels=3, num_classes=10):
    """ResNet-20 for CIFAR-shaped inputs (~0.27M parameters, see the module docstring)."""
    return ResNetCifar(3, in_channels=in_channels, num_classes=num_classes)


# ---------------------------------------------------------------------------------
# VGG-16 with a large fully-connected head
# ---------------------------------------------------------------------------------


class VGG(nn.Module):
    """VGG convolution stack (with batch norm) plus a three-layer fully-connected head.

    Inputs must be a multiple of the stack's downsampling (32x32 for VGG-16's five
    pools); the first linear layer sees the last convolution's channels.
    """

    def __init__(self, layout=VGG16_LAYOUT, in_channels=3, num_classes=10, fc_width=4096,
                 dropout=0.5):
        super().__init__()
        _require_positive_int("in_channels", in_channels)
        _require_positive_int("num_classes", num_classes)
        _require_positive_int("fc_width", fc_width)
        _require_probability("dropout", dropout)
        layers = []
        channels = in_channels
        self.downsampling = 1
        for item in layout:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                self.downsampling *= 2
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1, bias=False),
                           nn.BatchNorm2d(item), nn.ReLU(inplace=True)]
                channels = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(channels, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, num_classes),
        )

    def forward(self, x):
        height, width = x.shape[-2:]
        if height % self.downsampling or width % self.downsampling:
            # a clear message instead of a shape error deep inside the stack
            raise ValueError(f"VGG input must be a multiple of {self.downsampling}x"
                             f"{self.downsampling} pixels, got {height}x{width}")
        # a no-op at 32x32; larger inputs are averaged down to 1x1
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(x.flatten(1))


def vgg16(in_channels=3, num_classes=10, fc_width=4096, dropout=0.5):
    """VGG-16 (batch-norm variant) for 32x32 inputs with an FC head of ``fc_width``."""
    return VGG(VGG16_LAYOUT, in_channels=in_channels, num_classes=num_classes,
               fc_width=fc_width, dropout=dropout)


# ---------------------------------------------------------------------------------
# Character-level LSTM language model
# ---------------------------------------------------------------------------------


class CharLSTM(nn.Module):
    """Embedding -> multi-layer LSTM -> linear decoder over the vocabulary.

    ``forward(tokens)`` takes int64 tokens of shape (batch, seq_len) and returns logits
    of shape (batch, seq_len, vocab_size): position t predicts token t + 1. Every batch
    starts from a zero hidden state, so batches are independent (needed for
    DistributedSampler's shuffling and for exact checkpoint/resume).
    """

    def __init__(self, vocab_size, embedding_dim=128, hidden_size=256, num_layers=2,
                 dropout=0.0):
        super().__init__()
        _require_positive_int("vocab_size", vocab_size)
        _require_positive_int("embedding_dim", embedding_dim)
        _require_positive_int("hidden_size", hidden_size)
        _require_positive_int("num_layers", num_layers)
        _require_probability("dropout", dropout)
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens):
        if tokens.dim() != 2:
            raise ValueError(f"CharLSTM expects tokens of shape (batch, seq_len), "
                             f"got {tuple(tokens.shape)}")
        out, _ = self.lstm(self.embedding(tokens))
        return self.decoder(out)


def lstm(vocab_size, embedding_dim=128, hidden_size=256, num_layers=2, dropout=0.0):
    """Character-level LSTM language model (2 layers by default)."""
    return CharLSTM(vocab_size, embedding_dim=embedding_dim, hidden_size=hidden_size,
                    num_layers=num_layers, dropout=dropout)


_CONSTRUCTORS = {"resnet20": resnet20, "vgg16": vgg16, "lstm": lstm}


def build_model(name, **options):
    """Construct the model called ``name`` (one of ``MODEL_NAMES``) with ``options``.

    CNNs take ``in_channels`` and ``num_classes`` (``vgg16`` also ``fc_width`` and
    ``dropout``); ``lstm`` needs ``vocab_size``.
    """
    constructor = _CONSTRUCTORS.get(name)
    if constructor is None:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(MODEL_NAMES)}")
    return constructor(**options)
