"""The demo model: the synthetic shapes it learns (``synthetic``), its build and training
(``build``, ``python -m demo_model.build``) and its evaluation through the engine
(``evaluation``). Tests, the demo and benchmarks use it; the engine (llava/) never imports it."""
