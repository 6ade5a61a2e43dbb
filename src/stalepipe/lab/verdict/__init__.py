"""Does asynchronous pipelining pay off: the token overhead against the throughput edge
(docs/verdict.md): the command, its rule, its decision block, throughputs and the cluster model."""
