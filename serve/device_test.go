package serve

import (
	"errors"
	"fmt"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/cuda/cudaemu"
	"distill/infer"
)

// TestCoreOnCUDA: --device cuda (teacherd, cachectl fill --model) runs the
// teacher's forward on the CUDA backend, here the CPU emulator of CUDA,
// and its top-k agrees with the CPU teacher's within BF16 rounding; auto
// takes the GPU too and says so.
func TestCoreOnCUDA(t *testing.T) {
	cudaemu.Use(t)
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	mdir := tinyModel(t)
	cpuCore, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cpu"})
	if err != nil {
		t.Fatal(err)
	}
	defer cpuCore.Close()
	samples := [][]int32{{1, 2, 3, 4, 5, 6, 7, 8}, {300, 12}, {511, 0, 9, 9, 9}}
	const k = 5
	want, err := cpuCore.Model().TopK(samples, infer.Options{K: k, Temperature: 1})
	if err != nil {
		t.Fatal(err)
	}
	for _, dev := range []string{"cuda", "auto"} {
		var lines []string
		core, err := NewCore(CoreOptions{ModelDir: mdir, Device: dev,
			DeviceLogf: func(f string, a ...any) { lines = append(lines, fmt.Sprintf(f, a...)) }})
		if err != nil {
			t.Fatalf("--device %s on the emulated GPU: %v", dev, err)
		}
		if got := core.Info().GetDevice(); got != "cuda" {
			t.Errorf("--device %s: Info reports device %q, want cuda", dev, got)
		}
		if dev == "auto" && !strings.Contains(strings.Join(lines, "\n"), "device auto: using") {
			t.Errorf("--device auto: no line says what it chose: %q", lines)
		}
		got, err := core.Model().TopK(samples, infer.Options{K: k, Temperature: 1})
		if err != nil {
			t.Fatal(err)
		}
		// BF16 GEMM inputs move these log-probs (weights of std 0.5, so
		// large activations) by up to a few 1e-2, as in compute/cuda's
		// golden tests; ids may swap only between near-equal log-probs.
		worst := 0.0
		for s := range samples {
			lp := want[s].LogProbs
			for i := range want[s].IDs {
				d := math.Abs(float64(got[s].LogProbs[i] - lp[i]))
				worst = max(worst, d)
				if d > 0.1 {
					t.Fatalf("--device %s: sample %d entry %d: log-prob %v, cpu %v", dev, s, i, got[s].LogProbs[i], lp[i])
				}
				r := i % k
				near := (r > 0 && lp[i-1]-lp[i] < 0.1) || (r+1 < k && lp[i]-lp[i+1] < 0.1)
				if got[s].IDs[i] != want[s].IDs[i] && !near {
					t.Fatalf("--device %s: sample %d entry %d: id %d, cpu %d (not a near-tie)", dev, s, i, got[s].IDs[i], want[s].IDs[i])
				}
			}
		}
		t.Logf("--device %s: max |Δ log-prob| vs cpu %.3g", dev, worst)
		core.Close()
	}
}

// TestCoreRefusesBudgetOverDeviceMemory: a token budget whose forward
// does not fit the GPU's memory once the weights are loaded is refused
// when the teacher starts (teacherd, cachectl fill --model), with an error
// that names a budget that fits; that budget starts. The emulated device
// is shrunk to what one more copy of the weights, the reserve and a small
// forward need.
func TestCoreRefusesBudgetOverDeviceMemory(t *testing.T) {
	cudaemu.Use(t)
	if cudaemu.OnGPU() {
		t.Skip("shrinks the emulator's device")
	}
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	mdir := tinyModel(t)
	memUsed := func(c *Core) int64 {
		free, total := c.Model().Backend().(compute.DeviceMemory).MemInfo()
		return total - free
	}
	a, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", TokenBudget: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	usedA := memUsed(a) // the emulated device's use (all of this process's backends)
	b, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", TokenBudget: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	perCore := memUsed(b) - usedA // one more teacher: its backend, weights and first-use copies
	room := b.Model().DeviceBytes(400, 400, DefaultKDefault, DefaultMaxDraws)
	mem := memUsed(b) + perCore + 256<<20 + room
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(mem))
	_, err = NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", TokenBudget: 1 << 16, KMax: DefaultKDefault})
	if !errors.Is(err, ErrInvalid) || !errors.Is(err, infer.ErrDeviceMemory) {
		t.Fatalf("token budget 65536 on a device with room for about 400 tokens: %v", err)
	}
	t.Logf("%v", err)
	sub := regexp.MustCompile(`lower --token-budget to (\d+) or less`).FindStringSubmatch(err.Error())
	if sub == nil {
		t.Fatalf("the error names no budget that fits: %v", err)
	}
	fits, _ := strconv.Atoi(sub[1])
	// The refused teacher's weights stay on the emulated device (a
	// process that gets this error exits); the next one gets room of its
	// own.
	t.Setenv("DISTILL_EMU_DEVICE_MEM", fmt.Sprint(mem+perCore))
	c, err := NewCore(CoreOptions{ModelDir: mdir, Device: "cuda", TokenBudget: fits, KMax: DefaultKDefault})
	if err != nil {
		t.Fatalf("the suggested token budget %d: %v", fits, err)
	}
	c.Close()
}
