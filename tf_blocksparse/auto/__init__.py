"""The automatic exchange (``exchange="auto"``) of the optimizer wrapper, on TensorFlow.

One part, from measurement to switch; its policy and cost model are TensorFlow-free
(:mod:`tf_blocksparse.planning.exchange_cost`, :mod:`tf_blocksparse.planning.link_cost`,
which also names the modes):

- :mod:`~tf_blocksparse.auto.link_probe`: the measurements (collectives timed on the
  running strategy, compression timed locally, figures agreed over every worker).
- :mod:`~tf_blocksparse.auto.auto_exchange`: the controller, ``ExchangeChooser`` (measures,
  decides, keeps every fusion group's mode).
- :mod:`~tf_blocksparse.auto.auto_callback`: ``AutoExchangeCallback`` (re-decides during
  ``model.fit``, see :mod:`tf_blocksparse.keras.fit_loop`).
- :mod:`~tf_blocksparse.auto.auto_runtime`: what the modes change in the optimizer's step
  (the dense phase included).
- :mod:`~tf_blocksparse.auto.mode_switch`: the state that moves when a group changes mode.

Nothing is imported here: ``import tf_blocksparse.auto.link_probe`` loads what it needs.
"""
