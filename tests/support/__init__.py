"""Test scaffolding for running Megatron-Core MoE models under any parallel layout.

* ``launcher``: ``run_workers(fn, world_size, *args)`` runs ``fn`` on N ranks
  (gloo on CPU, NCCL on ``cuda:rank``) and returns each rank's result.
* ``parallel``: ``Layout`` (TP/SP/PP/VP/CP/EP/ETP/DP, dispatcher, uneven PP,
  recompute, packed; ``Layout.flags``, the launcher's flags) and ``init_parallel``
  (parallel state, through the launcher's ``init_model_parallel``, + RNG in a worker).
* ``tiny_moe``: ``TinyMoE`` hyper-parameters (``TinyMoE.flags``), ``launcher_args``,
  ``build_gpt`` (this rank's config and model chunks from the launcher's model
  factory, weights from a seed).
* ``weights``: full single-rank names and slices of sharded parameters; seeded
  init, ``load_full``, Megatron-style gradient reduction, ``assemble``.
* ``batches``: test data as sequences with global token ids; per-rank BSHD
  (DP + Megatron CP slicing) and packed THD (padding + zigzag) microbatches.
* ``schedule``: forward/backward through ``get_forward_backward_func``.
* ``routes``: router rows -> global token ids; ``RouterRecorder``.
* ``harness``: ``run_layout``, the one-step worker, and the parent-side
  ``full_token_losses`` / ``full_grads`` / ``routes``.
* ``counting_file``: ``CountingFile``, an in-memory file counting the bytes read.
* ``planted``: ``unchecked_writer`` (dumps holding what the writer refuses) and
  ``snapshot`` (checksums of a folder's files, before and after a refusal).
"""
