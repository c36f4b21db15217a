"""Rollout data on its way from the engine's output to the router. The types every part shares are here
(``samples``, ``routes``, ``route_checks``, ``sample_checks``); ``engines`` turns what rollout engines
return into samples, ``formats`` holds the rollout dump and the tools' files, and ``device`` takes
samples to what a forward step feeds the model: packed rows, route plans, packing, transport, prefetch.
"""
