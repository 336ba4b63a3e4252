"""Deploy the serving image to a SageMaker real-time endpoint: ``python -m deploy --help``.

``deploy.endpoint`` holds the steps (create model → endpoint config → endpoint, wait, delete);
``deploy.__main__`` is the command line over them. Uses the SageMaker Python SDK v3's
resource layer, ``sagemaker-core`` (the ``deploy`` extra in setup.cfg).
"""
