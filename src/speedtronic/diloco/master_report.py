"""The workers' side of the master's rejection feedback, where coordinator.py imports it from (they
live in diloco/master/report.py; the worker package takes them from there directly later)."""

from speedtronic.diloco.master.report import own_rejections, rejection_streak

__all__ = ["own_rejections", "rejection_streak"]
