"""Thin adapters between SGLang and the probe: the probe's only code that knows SGLang
(the SGLang test bed, testbed/sglang, aside).

* hooks: ``pd_prefill``, ``pd_decode`` and ``hicache`` hold the wrapper
  factories ``make_<name>_wrapper(runtime)`` that the patch-target files
  under ``configs/targets/`` name;
* what the hooks read: ``accessors`` (requests, queues, transfer objects),
  ``index_k`` (the DeepSeek-V4 pool's index-K geometry, a room's pages) and
  ``sides`` (a role's side built from that pool, assembled by
  dsv4_idxk_probe.pd.assembly);
* ``enforce``: enforce mode's agreement and all-reduce between the
  attention-TP ranks;
* patching: ``targets`` (load and resolve a target table), ``patcher``
  (apply and remove the hooks), ``package`` (the SGLang releases supported).

Importing this package imports no SGLang module.
"""
