package cpu

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

const (
	xeonAVX512 = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16\n"
	epycZen3   = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
	intelAVX2  = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
	oldSSE     = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 sse3\n"
)

// TestPreferredCore: the core is read from the CPU's flags: AVX-512 is
// SkylakeX whoever makes it, AVX2 with FMA Zen on AMD and Haswell
// elsewhere, and nothing is preferred on an older CPU.
func TestPreferredCore(t *testing.T) {
	for cpuinfo, want := range map[string]string{xeonAVX512: "SkylakeX", epycZen3: "Zen", intelAVX2: "Haswell", oldSSE: "", "": ""} {
		if got := PreferredCore(cpuinfo); got != want {
			t.Errorf("PreferredCore(%q) = %q, want %q", cpuinfo, got, want)
		}
	}
}

// TestBetterCore: a re-run is asked for only when OpenBLAS picked weaker
// kernels than the CPU runs (the Xeon: Prescott for SkylakeX),
// and never when the user named a core or turned the choice off.
func TestBetterCore(t *testing.T) {
	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	for _, c := range []struct {
		current, cpuinfo string
		env              func(string) string
		want             string
	}{
		{"Prescott", xeonAVX512, env(), "SkylakeX"},
		{"Haswell", xeonAVX512, env(), "SkylakeX"},
		{"Sandybridge", epycZen3, env(), "Zen"},
		{"SkylakeX", xeonAVX512, env(), ""},
		{"Haswell", intelAVX2, env(), ""},
		{"Zen", intelAVX2, env(), ""},
		{"Prescott", oldSSE, env(), ""},
		{"SomethingNew", xeonAVX512, env(), ""},
		{"Prescott", xeonAVX512, env("OPENBLAS_CORETYPE", "Haswell"), ""},
		{"Prescott", xeonAVX512, env(AutoCoreEnv, "0"), ""},
		{"Prescott", xeonAVX512, env("OPENBLAS_CORETYPE", "Prescott", AutoCoreEnv, "force"), "SkylakeX"},
		{"SkylakeX", xeonAVX512, env("OPENBLAS_CORETYPE", "SkylakeX", AutoCoreEnv, "force"), ""},
	} {
		if got := betterCore(c.current, c.cpuinfo, c.env); got != c.want {
			t.Errorf("betterCore(%s, %q) = %q, want %q", c.current, c.cpuinfo, got, c.want)
		}
	}
}

// TestEnsureCoreChild is the re-executed side of TestEnsureCore and
// TestConformanceUnderPreferredCore: it names the core it runs.
func TestEnsureCoreChild(t *testing.T) {
	if os.Getenv("DISTILL_TEST_ENSURECORE") == "" {
		t.Skip("run by TestEnsureCore")
	}
	if os.Getenv("DISTILL_TEST_ENSURECORE") == "ensure" {
		EnsureCore(os.Stderr)
	}
	os.Stderr.WriteString("core=" + BLASCore() + "\n")
}

// TestEnsureCore: a program calling EnsureCore under kernels weaker than
// the CPU's best (OpenBLAS made to run Prescott's, as Debian 12's picks on
// an AVX-512 Xeon; DISTILL_OPENBLAS_AUTOCORE=force lets EnsureCore replace
// the OPENBLAS_CORETYPE that stands for OpenBLAS's choice here) says so in
// one line and runs again under the preferred core; with
// DISTILL_OPENBLAS_AUTOCORE=0, or a core the user set, it keeps the one it
// has; and the CPU backend's conformance suite passes under the preferred
// core.
func TestEnsureCore(t *testing.T) {
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	want := PreferredCore(string(cpuinfo))
	if coreRank(want) <= coreRank("Prescott") {
		t.Skipf("this CPU's best OpenBLAS core is %q: nothing better than Prescott to choose", want)
	}
	run := func(env ...string) string {
		cmd := exec.Command(os.Args[0], "-test.run", "^TestEnsureCoreChild$", "-test.v")
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%v: %v\n%s", env, err, out)
		}
		return string(out)
	}
	out := run("DISTILL_TEST_ENSURECORE=ensure", "OPENBLAS_CORETYPE=Prescott", AutoCoreEnv+"=force")
	if strings.Count(out, "cpu: OpenBLAS picked its Prescott kernels") != 1 || !strings.Contains(out, "core="+want+"\n") {
		t.Errorf("EnsureCore from Prescott to %s:\n%s", want, out)
	}
	for _, env := range [][]string{{AutoCoreEnv + "=0"}, {AutoCoreEnv + "="}} {
		out = run(append(env, "DISTILL_TEST_ENSURECORE=ensure", "OPENBLAS_CORETYPE=Prescott")...)
		if strings.Contains(out, "cpu: OpenBLAS picked") || !strings.Contains(out, "core=Prescott\n") {
			t.Errorf("with %v and OPENBLAS_CORETYPE=Prescott:\n%s", env, out)
		}
	}
	// The conformance suite and the GEMM tests under the chosen core.
	t.Run("conformance", func(t *testing.T) {
		if raceDetector {
			// The core changes only OpenBLAS's kernels, which the race
			// detector does not see, and this binary's TestConformance
			// already ran the suite under it: the run without -race
			// checks the suite under the chosen core (about 140 s here).
			t.Skip("under -race: the suite under the chosen core is the plain run's check")
		}
		cmd := exec.Command(os.Args[0], "-test.run", "^(TestConformance|TestSgemmAllTransposes|TestSgemmChecksLengths|TestEnsureCoreChild)$", "-test.v")
		cmd.Env = append(os.Environ(), "OPENBLAS_CORETYPE="+want, "DISTILL_TEST_ENSURECORE=report")
		b, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(b), "core="+want+"\n") || !strings.Contains(string(b), "--- PASS: TestConformance") {
			t.Errorf("the conformance suite under OPENBLAS_CORETYPE=%s: %v\n%s", want, err, b)
		}
	})
}
