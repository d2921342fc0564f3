"""The SGLang rig: SGLang's own PD servers on this machine, with the probe in them.

SGLang 0.5.23's real ``launch_server`` prefill and decode servers, its router,
its NIXL KV manager moving host memory over UCX on loopback; only the model
forward stands in (`standin_model`), plus the few CPU-only patches in
`cpu_patches`, each named in docs/rig.md with the reason. Both are loaded in
the servers through SGLang's own plugin mechanism from an entry point the rig
writes into its run folder (`launch.rig_plugin_site`), so nothing of the rig
is ever installed into a serving image.

The stand-in writes index-K through the pool's own store
(``set_index_k_scale_buffer``) with bytes `truth` defines, so the rig knows
every frozen byte; `oracle` checks them inside decode at each probe digest
point, `injector` corrupts them where docs/faults.md says (both fed by the
`hooks` on SGLang's classes, from the driver's `plan`), and `run` drives a
whole run and checks the probe's verdicts against both.
"""
