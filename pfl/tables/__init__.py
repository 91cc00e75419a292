"""Comparison tables: a YAML file (:mod:`.spec`) whose cells (row × seed) run as Ray Tune trials
(:mod:`.engine`) and are summarised over seeds on one MLflow parent run (:mod:`.report`);
``pfl table FILE.yaml`` (:mod:`.cli`)."""
