package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"

	"distill/model"
)

// tinyModel writes a small random Qwen3 checkpoint (vocab 512) once per
// test binary and returns its directory.
var tinyDir string

func tinyModel(t testing.TB) string {
	t.Helper()
	if tinyDir != "" {
		return tinyDir
	}
	dir, err := os.MkdirTemp("", "serve-tiny-model-")
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 512, 32, 1, 64, 256
	w := model.Init(cfg, model.InitOptions{Seed: 7, Std: 0.5, Perturb: true})
	if err := model.WriteCheckpoint(dir, cfg, w, "BF16"); err != nil {
		t.Fatal(err)
	}
	tinyDir = dir
	return dir
}

// writeIDsDataset writes n pre-tokenized records of 4..maxLen ids below
// vocab and returns the file and the ids.
func writeIDsDataset(t testing.TB, dir string, n, maxLen, vocab int, seed int64) (string, [][]int32) {
	t.Helper()
	r := rand.New(rand.NewSource(seed))
	path := filepath.Join(dir, "data.jsonl")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var all [][]int32
	for i := 0; i < n; i++ {
		ids := make([]int32, 4+r.Intn(maxLen-3))
		for j := range ids {
			ids[j] = int32(r.Intn(vocab))
		}
		b, _ := json.Marshal(map[string]any{"input_ids": ids})
		fmt.Fprintf(f, "%s\n", b)
		all = append(all, ids)
	}
	return path, all
}

func testLogger(t testing.TB) *zap.Logger {
	if os.Getenv("SERVE_TEST_LOG") != "" {
		l, _ := zap.NewDevelopment()
		return l
	}
	return zap.NewNop()
}

// startDaemon runs a daemon in this process on a loopback port.
func startDaemon(t testing.TB, cfg Config) *Daemon {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	if cfg.Metrics == "" {
		cfg.Metrics = "127.0.0.1:0"
	}
	d, err := Start(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Shutdown(context.Background()) })
	return d
}

// TestMain doubles as the daemon of the crash tests: with
// SERVE_TEST_DAEMON set, the test binary runs a daemon from environment
// variables instead of the tests, like cmd/teacherd does (signals, drain).
func TestMain(m *testing.M) {
	if os.Getenv("SERVE_TEST_DAEMON") == "" {
		code := m.Run()
		if tinyDir != "" {
			os.RemoveAll(tinyDir)
		}
		os.Exit(code)
	}
	budget, _ := strconv.Atoi(os.Getenv("SERVE_TEST_BUDGET"))
	hold, _ := strconv.Atoi(os.Getenv("SERVE_TEST_HOLD"))
	micro, _ := strconv.Atoi(os.Getenv("SERVE_TEST_MICRO_BATCHES"))
	cfg := Config{Model: os.Getenv("SERVE_TEST_MODEL"), Cache: os.Getenv("SERVE_TEST_CACHE"), Listen: os.Getenv("SERVE_TEST_LISTEN"),
		Metrics: "off", TokenBudget: budget, DrainTimeout: 20 * time.Second, DataRoots: []string{os.Getenv("SERVE_TEST_DATA_ROOT")},
		Device: os.Getenv("SERVE_TEST_DEVICE"), Devices: os.Getenv("SERVE_TEST_DEVICES"), MicroBatches: micro}
	os.Exit(daemonMain(cfg, hold))
}
