"""Model families (`families`, torch-free), the `sd3` family and the offline `tiny-sd3` builder."""
