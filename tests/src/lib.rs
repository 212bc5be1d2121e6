//! Test harness: starts containerd with a temporary config and builds images by hand.
