"""The bodies of the benchmark scripts: each module here holds the measurements of one script
of ``launch/`` (``fusion`` of ``launch.bench_fusion``, ``clipping`` of ``launch.bench_clipping``,
``selection`` of ``launch.bench_selection``, ``pipeline`` of ``launch.bench_pipeline``,
``scaling`` of ``launch.project_scaling``).  The thin main in ``launch/`` defines the flags and
imports its body only inside ``main``, when the benchmark runs, so that ``--help`` and a flag
error need no TensorFlow.
"""
