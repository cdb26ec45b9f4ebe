"""KFP container components of the ShardRL stages and the images they run in."""

from .images import SERVICE_IMAGES, STAGE_IMAGES, ImageSpec, build_tag, image_ref, revision
from .stages import stage_component

__all__ = ["SERVICE_IMAGES", "STAGE_IMAGES", "ImageSpec", "build_tag", "image_ref", "revision",
           "stage_component"]
