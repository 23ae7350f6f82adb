"""The native Java rules under rules_java's names (offline stand-in; bazel/WORKSPACE says why)."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
