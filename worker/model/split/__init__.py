"""One model split over layers into stages (``--gpus-per-worker N``, ``--split-stages N``):
where each layer goes (``placement``, pure) and the stages at run time (``stages``)."""
