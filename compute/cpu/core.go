package cpu

/*
char* openblas_get_corename(void);
*/
import "C"

import (
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
)

// AutoCoreEnv controls the OpenBLAS core choice of EnsureCore: unset, it
// is on unless OPENBLAS_CORETYPE is set (the user's choice stands); 0
// turns it off, so that OpenBLAS keeps the kernels it picked itself (some
// OpenBLAS releases had wrong kernels on some CPUs); force replaces an
// OPENBLAS_CORETYPE weaker than the CPU's best too.
const AutoCoreEnv = "DISTILL_OPENBLAS_AUTOCORE"

// BLASCore is the name of the kernel set OpenBLAS runs ("Haswell",
// "SkylakeX", "Prescott", ...): its own choice at load time, or the one
// OPENBLAS_CORETYPE named.
func BLASCore() string { return C.GoString(C.openblas_get_corename()) }

// coreRank orders OpenBLAS's x86-64 cores by the widest vector unit their
// kernels use: 1 SSE, 2 AVX, 3 AVX2 (+FMA), 4 AVX-512. 0: unknown.
func coreRank(core string) int {
	switch strings.ToLower(core) {
	case "skylakex", "cooperlake", "sapphirerapids":
		return 4
	case "haswell", "zen", "excavator", "steamroller":
		return 3
	case "sandybridge", "bulldozer", "piledriver":
		return 2
	case "prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "opteron", "opteron_sse3", "barcelona", "bobcat", "nano", "katmai", "coppermine", "northwood", "banias", "athlon":
		return 1
	}
	return 0
}

// PreferredCore is the OpenBLAS core this CPU supports best, read from
// the CPU's flags (cpuinfo is /proc/cpuinfo's text): SkylakeX with
// AVX-512 (F, BW, VL, DQ), else Zen on AMD or Haswell on others with AVX2
// and FMA, else "" (OpenBLAS's own choice is as good as ours).
func PreferredCore(cpuinfo string) string {
	var vendor string
	flags := map[string]bool{}
	for _, line := range strings.Split(cpuinfo, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "vendor_id":
			vendor = strings.TrimSpace(v)
		case "flags":
			for _, f := range strings.Fields(v) {
				flags[f] = true
			}
		}
		if vendor != "" && len(flags) > 0 {
			break
		}
	}
	switch {
	case flags["avx512f"] && flags["avx512bw"] && flags["avx512vl"] && flags["avx512dq"]:
		return "SkylakeX"
	case flags["avx2"] && flags["fma"] && vendor == "AuthenticAMD":
		return "Zen"
	case flags["avx2"] && flags["fma"]:
		return "Haswell"
	}
	return ""
}

// betterCore is the core to re-run under: PreferredCore when OpenBLAS
// picked a weaker one (by coreRank), unless the user named one
// (OPENBLAS_CORETYPE) or turned the choice off (AutoCoreEnv=0); "" to
// keep OpenBLAS's.
func betterCore(current, cpuinfo string, getenv func(string) string) string {
	if getenv(AutoCoreEnv) == "0" || (getenv("OPENBLAS_CORETYPE") != "" && getenv(AutoCoreEnv) != "force") {
		return ""
	}
	want := PreferredCore(cpuinfo)
	if want == "" || coreRank(current) == 0 || coreRank(current) >= coreRank(want) {
		return ""
	}
	return want
}

// EnsureCore makes OpenBLAS run the best kernels this CPU supports: when
// it picked weaker ones (an OpenBLAS older than the CPU: Debian 12's
// 0.3.21 takes a 2-core AVX-512 Xeon for a Prescott, at a quarter of the
// speed), it says so on log in one line and re-executes the program with
// OPENBLAS_CORETYPE set, which OpenBLAS reads only when it loads. It
// returns when nothing is to be done (OPENBLAS_CORETYPE set, AutoCoreEnv
// 0, OpenBLAS's choice as good, the CPU unknown) or the re-exec failed.
// Commands call it first thing in main.
func EnsureCore(log io.Writer) {
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return
	}
	cur := BLASCore()
	want := betterCore(cur, string(cpuinfo), os.Getenv)
	if want == "" {
		return
	}
	fmt.Fprintf(log, "cpu: OpenBLAS picked its %s kernels, this CPU runs %s ones: restarting with OPENBLAS_CORETYPE=%s (%s=0 keeps OpenBLAS's choice)\n", cur, want, want, AutoCoreEnv)
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(log, "cpu: restart failed (%v): going on with %s\n", err, cur)
		return
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPENBLAS_CORETYPE=") {
			env = append(env, kv)
		}
	}
	env = append(env, "OPENBLAS_CORETYPE="+want)
	err = syscall.Exec(exe, os.Args, env)
	fmt.Fprintf(log, "cpu: restart failed (%v): going on with %s\n", err, cur)
}
