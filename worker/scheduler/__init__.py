"""The scheduling cycle's side effects: the cycle (``cycle``) applies the pure decisions of
``scheduling`` to the jobs and pools its store (``store``, the database) reads, under one
lock (``lock``); ``loop`` runs it on a timer and on ``tunefleet.schedule``."""
