"""What the model is made of, in one room: the catalogs every other package reads.

* ``stages``: the five stages of a request (and the ranges inside them), the module prefixes each
  one runs.
* ``registry``: the module families (which module classes of the reference and the vendor model
  each family is, what the profiler sees of it, its roofline op group).

Both import nothing from the package, so measurement, analytic costs, roofline and reports can all
sit above them.
"""
from .registry import BY_FAMILY, CONTAINERS, OP_GROUP_NAMES, REGISTRY, FamilyEntry, family_of, op_group_families
from .stages import DECODE_STEP, PREPROCESS, RECORDED_STAGES, STAGES, VISION_STAGES, module_stage

__all__ = ["BY_FAMILY", "CONTAINERS", "OP_GROUP_NAMES", "REGISTRY", "FamilyEntry", "family_of", "op_group_families",
           "DECODE_STEP", "PREPROCESS", "RECORDED_STAGES", "STAGES", "VISION_STAGES", "module_stage"]
