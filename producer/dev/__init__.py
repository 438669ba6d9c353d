"""For the demo and the tests: the demo pipeline, its jobs, an embedded Redis server."""
