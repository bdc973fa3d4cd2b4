"""Tests for libs.models."""
