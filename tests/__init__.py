"""A regular package on purpose: the SageMaker SDK's dependency smdebug-rulesconfig installs a
top-level ``tests`` package into site-packages, which would shadow a namespace package here
(``from tests.conftest import ...`` would fail)."""
