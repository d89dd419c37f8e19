"""OMGS-SGD in Lightning: a ``DDPStrategy`` that registers the hook on the DDP model.

Use::

    from omgs_hook.lightning import OMGSStrategy
    strategy = OMGSStrategy(omgs_options={"density": 0.001, "profile": "profile.json"},
                            process_group_backend="gloo", bucket_cap_mb=1)
    trainer = lightning.pytorch.Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model)
    print(strategy.omgs_state.stats()["total"])

Why a strategy of its own: Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``
registers a communication hook only when the device is CUDA - on the CPU it silently
trains with plain all-reduce. There (on CUDA) it works with ``OMGSState(...)`` built
without a module, at a cost: residuals are named ``param0, param1, ...`` in bucket order
instead of by parameter name, and the forward pass is not timed (the planner then sees
forward as 0 s, which shifts every plan's prediction by the same amount). ``OMGSStrategy``
calls :func:`omgs_hook.register` on the wrapped model instead, on every device, so names
and forward timing work; its options are validated when the strategy is built, before
any process is started.

With ``precision="16-mixed"`` the plugin's ``GradScaler`` is passed to the hook
(``grad_scaler``), so the residuals follow the loss scale.

Residuals are per rank: Lightning's checkpoints (written by rank 0) do not carry them.
Save ``strategy.omgs_state.state_dict()`` on every rank if a run must resume bit-exactly
(a callback's ``on_save_checkpoint`` runs on every rank), and load it back in a
callback's ``on_train_start`` (``trainer.strategy.omgs_state``).
A second ``trainer.fit()`` of the same module with the same strategy carries the hook's
state over itself; a fit of another module starts afresh. Whenever Lightning restores
the module's weights from a checkpoint (``ckpt_path=``, the ``LearningRateFinder``'s
return to the weights it started from), the hook's state starts afresh too, as in a new
process (``on_train_start`` runs after the restore).

The DDP model's forward is the whole ``training_step``: in manual optimization (a GAN,
an optimizer each) its backwards and ``zero_grad()`` calls all come after it, so the
hook decides whether a step's gradient was applied or dropped (``on_unapplied``) before
each backward (``pre_backward``), not at the forward.

Needs the ``lightning`` extra (``pip install 'omgs-hook[lightning]'``).
"""

import logging

import torch
from torch.nn.parallel import DistributedDataParallel
from lightning.pytorch.strategies import DDPStrategy

from .hook import OMGSState, register

logger = logging.getLogger(__name__)


class OMGSStrategy(DDPStrategy):
    """``DDPStrategy`` with the OMGS hook registered on the ``DistributedDataParallel`` model.

    Args:
        omgs_options (dict): options of :class:`omgs_hook.OMGSState` (``density``,
            ``profile``, ``strategy``, ...); validated here, ``process_group`` and
            ``module`` are supplied.
        **ddp_kwargs: everything ``DDPStrategy`` takes (``process_group_backend``,
            ``bucket_cap_mb`` and other ``DistributedDataParallel`` arguments), except
            ``ddp_comm_state``/``ddp_comm_hook``/``ddp_comm_wrapper``.

    Attributes:
        omgs_state: the :class:`omgs_hook.OMGSState` once training started (None before).
            With ``start_method="spawn"`` or ``"fork"`` the ranks train in child
            processes, so the main process's stays None after ``fit``: read
            ``trainer.strategy.omgs_state.stats()`` in a callback (``on_train_end``
            runs on every rank) instead.
    """

    strategy_name = "omgs_ddp"

    def __init__(self, omgs_options=None, **ddp_kwargs):
        for name in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if ddp_kwargs.get(name) is not None:
                raise ValueError(f"OMGSStrategy registers the OMGS hook itself; do not pass {name}")
        if omgs_options is not None and not isinstance(omgs_options, dict):
            raise TypeError(f"omgs_options must be a dict, got {type(omgs_options).__name__}")
        self.omgs_options = dict(omgs_options or {})
        for name in ("module", "process_group"):
            if name in self.omgs_options:
                raise ValueError(f"omgs_options: {name} is supplied by the strategy")
        # bad options fail now, with the option named. local_clip_norm needs the module,
        # which register() supplies: it is checked alone, with an empty module standing in
        # (a stand-in for all options would refuse a pinned plan of parameter names)
        options = dict(self.omgs_options)
        clip = options.pop("local_clip_norm", None)
        OMGSState(**options).close()
        if clip is not None:
            OMGSState(local_clip_norm=clip, module=torch.nn.Module()).close()
        super().__init__(**ddp_kwargs)
        self.omgs_state = None
        # the state as registered, before any step (what a restore in the fit rolls back
        # to), and whether the next fit may carry omgs_state over (see load_model_state_dict)
        self._omgs_fresh = None
        self._omgs_carry = True
        self._omgs_saved = None

    def configure_ddp(self):
        # the last fit's state, saved before DDP's constructor broadcasts the parameters:
        # that moves every parameter's version, and a decision still pending on the last
        # step's gradient (a GAN's generator step, whose discriminator gradient the next
        # zero_grad() clears) read as an optimizer step, so the step was kept
        self._omgs_saved = None
        if (self.omgs_state is not None and self._omgs_carry
                and self.omgs_state.module is self.model):
            self._omgs_saved = self.omgs_state.state_dict()
        super().configure_ddp()

    def _register_ddp_hooks(self):
        # DDPStrategy.configure_ddp calls this right after wrapping the model in DDP;
        # Lightning's own version registers hooks on CUDA only.
        # A second trainer.fit() of the same module wraps it in a new DDP model: the new
        # state takes over the last one's residuals, step count, plan and measurements (a
        # fresh one dropped the residuals without a word), as a resume into a fresh DDP
        # model does. Not for another module (its residuals are another model's), nor
        # after Lightning restored the module's weights from a checkpoint since
        saved, self._omgs_saved = self._omgs_saved, None
        if self.omgs_state is not None:
            self.omgs_state.close()
        self.omgs_state = register(self.model, **options_with_scaler(
            self.omgs_options, getattr(self, "precision_plugin", None)))
        self._omgs_fresh = self.omgs_state.state_dict()
        self._omgs_carry = True
        if saved is not None:
            self.omgs_state.load_state_dict(saved)

    def load_model_state_dict(self, checkpoint, strict=True):
        # Lightning restores the module's weights from one of its checkpoints, which do
        # not carry the hook's (per-rank) state: residuals, step count and plan belong to
        # other weights now. In a fit (the LR finder's restore of the weights it started
        # from) the state is rolled back to a fresh one; between fits (ckpt_path=), the
        # next fit does not carry it over. Either way the hook starts afresh, as a resume
        # from that checkpoint in a new process does (its per-rank state can be loaded
        # back in a callback's on_train_start, which runs after this)
        super().load_model_state_dict(checkpoint, strict=strict)
        state = self.omgs_state
        if state is None:
            return
        if (isinstance(self.model, DistributedDataParallel) and not state._closed
                and state.module is self.model.module):
            if state.step > 0 or state.memory.state_dict():
                logger.warning("omgs_hook: Lightning restored the model's weights from a "
                               "checkpoint at step %d of the hook: its state (residuals, "
                               "step count, plan) starts afresh", state.step)
            state.load_state_dict(self._omgs_fresh)
        else:
            self._omgs_carry = False

    def pre_backward(self, closure_loss):
        # the DDP model's forward is the whole training_step: in manual optimization it
        # runs several backwards, each after its own zero_grad(), so whether the last
        # step's gradient was applied or dropped (a GAN's generator step leaves the
        # discriminator's) is decided here, before each backward, not at the forward
        if self.omgs_state is not None and isinstance(self.model, DistributedDataParallel):
            self.omgs_state.before_backward()
        super().pre_backward(closure_loss)


def options_with_scaler(options, precision_plugin):
    """``options`` with ``grad_scaler`` set to the precision plugin's GradScaler (Lightning's
    ``"16-mixed"``), unless the options name one: the hook must follow the loss scale
    (``OMGSState``'s ``grad_scaler``). bf16 and full precision have no scaler."""
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or "grad_scaler" in options:
        return dict(options)
    return dict(options, grad_scaler=scaler)
