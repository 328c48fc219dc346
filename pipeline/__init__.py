"""pipeline: the data pipeline on Apache Spark (PySpark >= 4.2).

* :mod:`pipeline.source`: the ``dledger`` data source (batch and streaming)
  over the cluster's committed HTTP reads; options in :mod:`pipeline.options`,
  the HTTP reading in :mod:`pipeline.fetch`;
* :mod:`pipeline.analyze` (``python -m pipeline analyze``): Spark jobs over
  harness histories and result files, with :mod:`pipeline.report`;
* :mod:`pipeline.session`: the SparkSession the commands build;
* :mod:`pipeline.examples.events_per_minute`: the README's streaming example;
* :mod:`pipeline.bench`: read throughput of the batch source.
"""
