package cuda

import (
	"os"
	"strings"
	"testing"
)

// requireNVRTC returns NVRTC, or skips the test when it is not installed.
// CI sets DISTILL_REQUIRE_NVRTC=1 (scripts/test.sh), and there a missing
// NVRTC fails the test instead: the proof that the kernels compile must
// not silently vanish.
func requireNVRTC(t testing.TB) *nvrtc {
	t.Helper()
	n, err := loadNVRTC()
	if err != nil {
		if os.Getenv("DISTILL_REQUIRE_NVRTC") == "1" {
			t.Fatalf("DISTILL_REQUIRE_NVRTC=1 but %v (scripts/setup.d/nvrtc.sh installs it)", err)
		}
		t.Skipf("NVRTC not installed, kernels not compiled: %v (scripts/setup.d/nvrtc.sh installs it; DISTILL_REQUIRE_NVRTC=1 makes this a failure)", err)
	}
	return n
}

// TestKernelsCompile compiles every embedded kernel file to a cubin for
// sm_80 (Ampere) and sm_90 (Hopper) with the installed NVRTC, and fails on
// any error or warning. It needs no GPU. With NVRTC 12 or newer it also
// compiles for sm_90a, the arch the backend picks on Hopper.
func TestKernelsCompile(t *testing.T) {
	n := requireNVRTC(t)
	t.Logf("NVRTC %s (%s)", n.Version(), n.lib.path)
	archs := []string{"sm_80", "sm_90"}
	if n.supportsArch("sm_90a") {
		archs = append(archs, "sm_90a")
	}
	files := kernelFiles()
	if len(files) < 5 {
		t.Fatalf("found %d embedded kernel files, want at least 5", len(files))
	}
	for _, f := range files {
		for _, arch := range archs {
			cubin, log, err := n.compile(string(f), f.source(), arch)
			if err != nil {
				t.Errorf("%s for %s: %v", f, arch, err)
				continue
			}
			if strings.TrimSpace(log) != "" {
				t.Errorf("%s for %s: NVRTC warned (warnings fail this test):\n%s", f, arch, log)
			}
			if !strings.HasPrefix(string(cubin), "\x7fELF") {
				t.Errorf("%s for %s: the cubin is not an ELF image", f, arch)
			}
			for _, k := range f.kernels() {
				if !strings.Contains(string(cubin), k) {
					t.Errorf("%s for %s: kernel %s is missing from the cubin (not extern \"C\"?)", f, arch, k)
				}
			}
		}
	}
}
