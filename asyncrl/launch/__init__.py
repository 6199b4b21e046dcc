"""Launchers that place the servers and the learner ranks: ``layout`` (what goes where, and which layouts
cannot work) and ``ray`` (Ray placement groups; needs ``pip install 'asyncrl[ray]'``). Under ``torchrun`` no
launcher module is needed: see ``asyncrl.examples.distributed_grpo``."""

from asyncrl.launch.layout import Layout

__all__ = ["Layout"]
