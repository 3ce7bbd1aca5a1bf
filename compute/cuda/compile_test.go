package cuda

import (
	"bytes"
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
// compiles for sm_90a, the arch the backend picks on Hopper. The files
// compiled in parallel, as Open compiles them, give the same cubins.
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
	seq := map[kernelFile][]byte{} // sm_80's cubins, one at a time
	for _, f := range files {
		for _, arch := range archs {
			cubin, log, err := n.compile(string(f), f.source(), arch)
			if arch == "sm_80" {
				seq[f] = cubin
			}
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
	// Open compiles the files in parallel (kernelCache.cubins): the same
	// cubins as one at a time, with no cache to hand them back.
	par := (&kernelCache{}).cubins(n, files, "sm_80", len(files))
	for i, f := range files {
		if par[i].err != nil || par[i].fromCache {
			t.Fatalf("%s compiled in parallel: err %v, from the cache %v", f, par[i].err, par[i].fromCache)
		}
		if !bytes.Equal(par[i].cubin, seq[f]) {
			t.Errorf("%s for sm_80: compiled in parallel, a cubin of %d bytes; one at a time, %d bytes that differ", f, len(par[i].cubin), len(seq[f]))
		}
	}
}
