"""The named geometries: global ``(B, S_global, H, D)`` of the all-to-all's operand, one plane per batch element.

``wan720p`` is Wan 2.1's 720p latent at one plane; the ``h3`` ones are packed q/k/v (B = 3 planes) at 56 heads;
``toy`` is the benchmarks' CPU size. ``explain --geometry`` and the benchmarks' ``--geometry`` read this one table.
Pure data and no imports: the benchmarks load this file by path, before they choose the package tree they measure.
"""

GEOMETRIES: dict[str, tuple[int, int, int, int]] = {
    "wan720p": (1, 75600, 40, 128),
    "h3-32k": (3, 32768, 56, 128),
    "h3-128k": (3, 131072, 56, 128),
    "h3-250k": (3, 250000, 56, 128),
    "toy": (3, 512, 8, 32),
}
