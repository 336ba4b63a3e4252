"""Tests. A regular package, so that a site-packages "tests" cannot shadow it
(smdebug_rulesconfig, a sagemaker SDK dependency, installs one).
"""
