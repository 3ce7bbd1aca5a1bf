// Command student makes, trains and exports student models: `init` writes
// a random HF checkpoint of a given architecture and size. Each subcommand
// lives in its own file and registers itself in init.
package main

import (
	"os"

	"distill/compute/device"
	"distill/internal/cli"
)

// commands holds the subcommands; each registers itself from its own file.
var commands = cli.New("student")

func init() {
	// cli.Interrupted's Exit0: a SIGTERM'd student train exits 0 unless
	// its config says 143 (train_cmd.go).
	commands.SignalStatuses = "130 for Ctrl-C; after SIGTERM, student train\nexits its train.sigterm_exit_status: 0 by default, or 143"
}

func main() {
	device.EnsureCPUCore(os.Stderr)
	commands.Main(os.Args[1:])
}
