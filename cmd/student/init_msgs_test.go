package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestInitMessages: an unknown --arch lists the valid ones, and -h shows
// each default once (no "(default -1)" after a flag whose default the
// text gives).
func TestInitMessages(t *testing.T) {
	err := runInit([]string{"--arch", "gpt2", "--out", filepath.Join(t.TempDir(), "m")})
	if err == nil || !strings.Contains(err.Error(), `"gpt2": want llama, qwen2, qwen3 or qwen3_moe`) {
		t.Errorf("--arch gpt2: %v", err)
	}
	var help bytes.Buffer
	initUsage = &help
	err = runInit([]string{"-h"})
	initUsage = os.Stderr
	if err != flag.ErrHelp {
		t.Fatalf("-h: %v", err)
	}
	for _, line := range strings.Split(help.String(), "\n") {
		if strings.Count(line, "(default") > 1 {
			t.Errorf("-h: %q gives its default twice", line)
		}
	}
	if !strings.Contains(help.String(), "router_aux_loss_coef") {
		t.Errorf("-h output %q", help.String())
	}
	if err := runInit([]string{"--arch", "qwen3_moe", "--router-aux-loss-coef", "x", "--out", filepath.Join(t.TempDir(), "m")}); err == nil || !strings.Contains(err.Error(), "--router-aux-loss-coef x: want a number >= 0") {
		t.Errorf("--router-aux-loss-coef x: %v", err)
	}
}
