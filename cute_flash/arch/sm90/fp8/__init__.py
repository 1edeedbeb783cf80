"""The sm90 FP8 forward (e4m3 WGMMA for both GEMMs): its kernel, a subclass of the bf16 forward that fills the
skeleton's FP8 hooks (`flash_fwd`), and what only FP8 needs: tile configurations (`tile_config`), the block-scaled
online softmax (`softmax`), the in-register P permutation (`permute`) and the host-side build and launch with the
GPU pre-pass (`launch`). The same file names as the arch package itself, one level down."""
