"""The composition root: the one place that builds the parts and wires them together.

It builds the per-process resources and the check pool (:mod:`.runtime`), lists the maintenance jobs
(:mod:`.jobs`) and the beat entries and Celery settings (:mod:`.celery_config`), defines the Celery
application and its tasks (:mod:`.celery_app`, :mod:`.tasks`) and connects the worker's signal hooks
(:mod:`.worker`, :mod:`.instance_hooks`). Nothing below imports it.
"""
